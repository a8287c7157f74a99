"""`python -m producers.prompts [--config YAML] [--nats URL] [--run R] [--steps N] [--out DIR]`:
the main job.

With no `--nats`, this is the whole job on one machine: an embedded nats-server, a local
fleet (trainer, buffer, reward, rollout as subprocesses), the run to the end with live
progress, then metrics, a summary and plots under the run directory. With `--nats URL` it
only feeds prompts to a run whose fleet runs elsewhere (and still reports progress).

    arguments -> run config (+ --steps, --run) -> the built-in model if none is named
        -> producers.launcher.run (the gate feeds prompts until the trainer's last step)
        -> the summary as the last line; or, on SIGINT/SIGTERM, one line saying how to resume
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
from producers.gate import PromptsRefused
from producers.launcher import Stopped, prepare, run, stop_on_sigterm
from schemas.config import ConfigError, RunConfig, load_config

BUILTIN = Path(__file__).resolve().parent.parent / "examples" / "digits.yaml"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m producers.prompts", description=__doc__.split("\n\n")[0]
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
    args = parser.parse_args(argv)
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
    """The config file with the command line's overrides; exits with one line if it is bad."""
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        sys.exit(f"producers.prompts: {exc}")
    if args.steps is not None:
        cfg = cfg.model_copy(
            update={"trainer": cfg.trainer.model_copy(update={"steps": args.steps})}
        )
    if args.run is not None:
        cfg = cfg.model_copy(update={"run": args.run})
    return cfg


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)  # the run's loop takes it over once it runs
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s producer %(levelname)s %(message)s"
    )
    cfg = run_config(args)
    out: Path = args.out or Path("runs") / f"{cfg.run}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = prepare(cfg, out)
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
    except (ConnectRefused, CannotAttach, PromptsRefused) as exc:
        sys.exit(f"producers.prompts: {exc}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
