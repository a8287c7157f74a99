"""`python -m producers.prompts [--config YAML] [KEY.PATH=VALUE ...] [--nats URL] [--run R]
[--steps N] [--out DIR] [--dry-run]`: the main job.

With no `--nats`, this is the whole job on one machine: an embedded nats-server, a local
fleet (trainer, buffer, reward, rollout as subprocesses), the run to the end with live
progress, then metrics, a summary and plots under the run directory. With `--nats URL` it
only feeds prompts to a run whose fleet runs elsewhere (and still reports progress).

    arguments -> run config (the file, its KEY.PATH=VALUE overrides, `schemas.overrides`;
        then --steps, --run) -> [--dry-run: print it and its stream limits, exit 0]
        -> the built-in model if none is named
        -> producers.launcher.run (the gate feeds prompts until the trainer's last step)
        -> the summary as the last line; or, on SIGINT/SIGTERM or a reward function failing
           most samples (`reward.max_failed_share`), one line saying why and how to resume
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import signal
import sys
import time
from pathlib import Path

from bus.connection import ConnectRefused
from bus.runtime import CannotAttach
from bus.topology import run_id_arg
from consumers.supervisor import FleetFailed
from producers import datasets, dry_run
from producers.drops import RewardsFailing
from producers.gate import PromptsRefused
from producers.launcher import Stopped, WarmStartFailed, prepare, run, stop_on_sigterm
from schemas.config import ConfigError, DataConfig, RunConfig
from schemas.overrides import (
    OverrideError,
    add_overrides_argument,
    help_epilog,
    load_with_overrides,
)

BUILTIN = Path(__file__).resolve().parent.parent / "examples" / "digits.yaml"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    prog = "python -m producers.prompts"
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=help_epilog(
            prog, "--config examples/digits.yaml trainer.steps=20 algorithm.lr=1e-5"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=BUILTIN,
        help="run config YAML (default: the built-in example)",
    )
    parser.add_argument(
        "--nats", help="NATS URL of a running cluster; omitted: embedded server + local fleet"
    )
    # A fleet supervisor starts every process with `--run R --nats URL`: the producer too
    # (`ops.chaos` supervises it to kill and restart it).
    parser.add_argument("--run", type=run_id_arg, help="run id (overrides the config's `run`)")
    parser.add_argument(
        "--replicas",
        type=int,
        choices=[1, 3, 5],
        default=1,
        help="stream replicas when this run's streams are created (3 on a NATS cluster)",
    )
    parser.add_argument(
        "--steps", type=int, help="stop after this many optimizer steps (overrides trainer.steps)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="run directory; an existing one is resumed (default: runs/<run>-<time>)",
    )
    add_overrides_argument(parser, "config")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config and its stream limits, and exit without starting anything",
    )
    args = parser.parse_intermixed_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def resume_args(argv: list[str] | None, out: Path) -> list[str]:
    """The command line that resumes this run: the same arguments,
    with `--out` the run directory."""
    given = list(sys.argv[1:] if argv is None else argv)
    kept, args = [], iter(given)
    for arg in args:
        if arg == "--out":
            next(args, None)  # and its value
        elif not arg.startswith("--out="):
            kept.append(arg)
    return [*kept, "--out", str(out)]


def run_config(args: argparse.Namespace) -> RunConfig:
    """The config file with the command line's overrides; exits with one line if it is bad (2 if
    an override is: a usage error)."""
    try:
        cfg = load_with_overrides(RunConfig, args.config, args.overrides)
    except OverrideError as exc:
        print(f"producers.prompts: {exc}", file=sys.stderr)
        sys.exit(2)
    except ConfigError as exc:
        sys.exit(f"producers.prompts: {exc}")
    if args.steps is not None:
        cfg = cfg.model_copy(
            update={"trainer": cfg.trainer.model_copy(update={"steps": args.steps})}
        )
    if args.run is not None:
        cfg = cfg.model_copy(update={"run": args.run})
    return cfg


def missing_local_model(path: str | None) -> str | None:
    """Why a local job cannot load `path`, said before any worker starts, or None: a `.gguf`
    file or a path written as one (absolute, ./, ~) that is not there. A hub id (org/name) is
    left to the workers, which fetch it or find it in the cache."""
    if path is None or Path(path).expanduser().exists():
        return None
    if path.endswith(".gguf"):
        return f"model.path {path!r}: no such GGUF file"
    if path.startswith(("/", "./", "../", "~")):
        return f"model.path {path!r}: no such directory"
    return None


def unreadable_dataset(data: DataConfig) -> str | None:
    """Why `data.dataset` cannot feed the run, said before any worker starts, or None: no
    such file (a relative path is from the working directory), or rows the producer would
    refuse (not JSON, neither `prompt` nor `messages`, none at all)."""
    if data.dataset is None:
        return None
    path = Path(data.dataset).expanduser()
    if not path.is_file():
        return f"data.dataset {data.dataset!r}: no such file (in {Path.cwd()})"
    try:
        datasets.epoch_size(data)
    except (OSError, ValueError) as exc:
        return f"data.dataset: {exc}"
    return None


def unreadable_demonstrations(cfg: RunConfig) -> str | None:
    """`unreadable_dataset` for `model.warm_start.dataset`: said before the warm start."""
    warm = cfg.model.warm_start
    if warm is None or warm.dataset is None:
        return None
    if not Path(warm.dataset).expanduser().is_file():
        return f"model.warm_start.dataset {warm.dataset!r}: no such file (in {Path.cwd()})"
    try:
        next(datasets.demonstrations(warm, cfg.data))
    except (OSError, ValueError) as exc:
        return f"model.warm_start.dataset: {exc}"
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)  # the run's loop takes it over once it runs
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s producer %(levelname)s %(message)s"
    )
    cfg = run_config(args)
    if args.dry_run:
        print(dry_run.render(cfg, args.replicas), end="")
        return
    if args.nats is None and (missing := missing_local_model(cfg.model.path)):
        sys.exit(f"producers.prompts: {missing}")
    if unreadable := unreadable_dataset(cfg.data) or unreadable_demonstrations(cfg):
        sys.exit(f"producers.prompts: {unreadable}")
    out: Path = args.out or Path("runs") / f"{cfg.run}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        cfg = prepare(cfg, out)
    except WarmStartFailed as exc:
        sys.exit(f"producers.prompts: {exc}")
    print(
        f"run {cfg.run}: {cfg.trainer.steps} steps of {cfg.algorithm.prompts_per_step} prompts x "
        f"{cfg.data.n} samples; output in {out}",
        flush=True,
    )
    try:
        summary = run(cfg, out, args.nats, args.replicas)
    except (Stopped, KeyboardInterrupt) as exc:
        # Every child is stopped by now: the fleet and the embedded server were left on the way out.
        stopped = exc if isinstance(exc, Stopped) else Stopped("SIGINT", None)
        where = (
            "while starting"
            if stopped.steps is None
            else f"after {stopped.steps} of {cfg.trainer.steps} steps"
        )
        resume = shlex.join(["python", "-m", "producers.prompts", *resume_args(argv, out)])
        sys.exit(
            f"producers.prompts: stopped by {stopped.signal_name} {where}; "
            f"every worker stopped. Resume with: {resume}"
        )
    except RewardsFailing as exc:
        resume = shlex.join(["python", "-m", "producers.prompts", *resume_args(argv, out)])
        sys.exit(
            f"producers.prompts: stopped: {exc}; every worker stopped. Fix the reward function "
            f"({cfg.data.reward}), then resume with: {resume}"
        )
    except (ConnectRefused, CannotAttach, PromptsRefused) as exc:
        sys.exit(f"producers.prompts: {exc}")
    except FleetFailed as exc:  # its first line the root cause, then each failed worker's line
        sys.exit(f"producers.prompts: the run stopped: {exc}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
