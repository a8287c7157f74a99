"""`python -m ops.export --run R [--step N] OUT_DIR`: a trainer checkpoint as a Hugging Face model.

    python -m ops.export --run runs/demo-20260101-120000 --step 60 exported/
    AutoModelForCausalLM.from_pretrained("exported/"), AutoTokenizer.from_pretrained(...)

Writes config.json, safetensors weights, generation config, tokenizer files and the chat
template into OUT_DIR, from the checkpoint of whichever engine trained the run: torch, fsdp
(any rank count) or megatron (any tensor x pipeline parallel layout), merged into full tensors
(`engines.export`) and saved through transformers (`engines.export_hf`). Nothing is asked of
the bus: the checkpoint files and the model directory are all it reads.

    --run R      the run directory (what `ops.samples --out` and `ops.status --out` take), its
                 checkpoints in R/checkpoints; or a run id: runs/R, else the newest runs/R-*
                 (the main job's default directory, runs/<run>-<time>); or a checkpoint
                 directory itself (a run whose trainer.checkpoint_dir was set elsewhere)
    --step N     the step to export; the trainer keeps only its last checkpoint, so another
                 step is a one-line error naming the step on disk (default: that step)
    --model M    the model the run trained (model.path: a directory, hub id or .gguf), for its
                 config and tokenizer; default: the directory the checkpoint records the trainer
                 loaded, else R/model (the built-in model the main job builds there)
    --dtype D    float32 (default: the trainer's master weights as they are) or bfloat16 /
                 float16 (half the bytes)
    --force      replace a non-empty OUT_DIR

Progress lines go to stderr; the last line on stdout is the directory written. Bad input is
one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engines.export import POINTERS, ExportError, check_step, find_checkpoint, hf_state_dict
from engines.export_hf import DTYPES, check_out_dir, write_hf

RUNS = Path("runs")
"""Where the main job puts run directories by default (`producers.prompts --out`)."""


def run_dir(run: str, runs: Path = RUNS) -> Path:
    """The directory `--run` names: a path as given, else runs/<run>, else the newest
    runs/<run>-<time>; ExportError (one line) if none is there."""
    given = Path(run).expanduser()
    if given.is_dir():
        return given
    if (runs / run).is_dir():
        return runs / run
    dated = sorted(p for p in runs.glob(f"{run}-*") if p.is_dir()) if runs.is_dir() else []
    if dated:
        return dated[-1]  # <run>-YYYYmmdd-HHMMSS: the newest sorts last
    raise ExportError(
        f"--run {run}: no run directory {given}, {runs / run} or {runs / run}-* "
        "(give the run directory the main job printed, or its run id)"
    )


def checkpoint_dir(run: Path) -> Path:
    """The run's checkpoints: `run`/checkpoints, or `run` itself when it holds a checkpoint."""
    if any((run / name).is_file() for name in POINTERS.values()):
        return run
    if (run / "checkpoints").is_dir():
        return run / "checkpoints"
    raise ExportError(
        f"{run} has no checkpoints/ directory and holds no trainer checkpoint (a run whose "
        "trainer.checkpoint_dir is elsewhere: give that directory as --run)"
    )


def model_dir(model: str | None, recorded: Path | None, run: Path) -> Path:
    """Where the config and tokenizer come from (see the module doc); ExportError if nowhere."""
    from engines.model_source import ModelNotFound, resolve_model_path

    if model is not None:
        try:
            return resolve_model_path(model)
        except ModelNotFound as exc:
            raise ExportError(f"--model: {exc}") from None
    if recorded is not None and (recorded / "config.json").is_file():
        return recorded
    if (run / "model" / "config.json").is_file():
        return run / "model"
    where = f"the trainer loaded {recorded}, which is gone" if recorded else "it names no model"
    raise ExportError(
        f"which model the run trained is not known here ({where}, and {run / 'model'} is "
        "absent): give --model (the run's model.path)"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ops.export", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help="the HF directory to write")
    parser.add_argument(
        "--run", required=True, help="run directory, run id (runs/R, runs/R-*) or checkpoint dir"
    )
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the one there)")
    parser.add_argument("--model", help="the run's model.path (default: what the checkpoint says)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    return parser.parse_args(argv)


def export(args: argparse.Namespace) -> list[Path]:
    """The files written; ExportError for anything in the way."""
    from transformers import AutoConfig

    def progress(line: str) -> None:
        print(f"ops.export: {line}", file=sys.stderr, flush=True)

    check_out_dir(args.out, args.force)  # before reading gigabytes
    run = run_dir(args.run)
    checkpoint = find_checkpoint(checkpoint_dir(run))
    check_step(checkpoint, args.step)
    model = model_dir(args.model, checkpoint.model_dir, run)
    progress(f"model config and tokenizer from {model}")
    state = hf_state_dict(checkpoint, AutoConfig.from_pretrained(model), progress)
    return write_hf(
        state,
        model,
        args.out,
        dtype=DTYPES[args.dtype],
        force=args.force,
        progress=progress,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        files = export(args)
    except ExportError as exc:
        print(f"ops.export: {exc}", file=sys.stderr)
        return 1
    print(
        f"ops.export: wrote {len(files)} files: {', '.join(p.name for p in files)}", file=sys.stderr
    )
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
