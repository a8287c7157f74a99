"""`python -m ops.samples --out RUN [--step N] [--follow]`: what the model generated, readably.

Prints the run directory's `samples.jsonl` (written by the main job, `producers.samples`: every
`report.samples_every`-th group), one block per group:

    step 41  prompt demo/0/48  v40 (staleness 1)  trained  mean reward 0.625
      prompt: c3149=
      [0] reward 1.000  v40 s1  stop    3149<eos>
      [1] reward 0.250  v40 s1  length  3111111
      [2] reward 0.000  FAILED: timed out after 5s   ...
      [3] reward 1.000  v40 s1  stop  env 12/30 tok  '<tool_call>...'   (an episode)

`--step N` shows the groups trained in step N only; `--follow` keeps printing groups as the
job appends them, until Ctrl-C. Nothing is asked of the bus: the file is all it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

SAMPLES_FILE = "samples.jsonl"  # producers.samples.SAMPLES_FILE (ops reads; producers write)
FOLLOW_SECONDS = 0.5


def _version(version: int | None, staleness: int | None) -> str:
    if version is None:
        return "v?"
    return f"v{version}" + ("" if staleness is None else f" (staleness {staleness})")


def render(group: dict[str, Any]) -> str:
    """One group as a block of lines: a header, the prompt, one line per response."""
    step = group.get("step")
    outcome = group.get("outcome", "?")
    if outcome == "dropped":
        outcome = f"dropped: {group.get('dropped')}"
    head = (
        f"{'step ' + str(step) if step is not None else 'no step'}  prompt {group['prompt_id']}  "
        f"{_version(group.get('version'), group.get('staleness'))}  {outcome}  "
        f"mean reward {group.get('reward_mean', float('nan')):.3f}"
    )
    prompt = group.get("prompt")
    lines = [head, f"  prompt: {prompt if prompt is not None else group.get('prompt_ids')}"]
    for r in group.get("responses", []):
        version = "v?" if r.get("version") is None else f"v{r['version']}"
        if r.get("staleness") is not None:
            version += f" s{r['staleness']}"
        failed = f"  FAILED: {r['failed']}" if r.get("failed") else ""
        # A multi-turn episode's: its tool results and turn headers among its tokens.
        env = (
            f"  env {r['environment_tokens']}/{r.get('tokens')} tok"
            if r.get("environment_tokens")
            else ""
        )
        lines.append(
            f"  [{r['index']}] reward {r['reward']:.3f}  {version}  {r.get('finish', '?'):<6}"
            f"{env}  {r.get('text', '')!r}{failed}"
        )
    return "\n".join(lines)


def groups(lines: Iterator[str], step: int | None) -> Iterator[dict[str, Any]]:
    """The groups of these JSON lines (those of `step` only, if given); a broken line skipped."""
    for line in lines:
        if not line.strip():
            continue
        try:
            group = json.loads(line)
        except json.JSONDecodeError:
            continue
        if step is None or group.get("step") == step:
            yield group


def follow(file: TextIO) -> Iterator[str]:
    """The file's lines, then each line appended, for ever (a partial line waits for its end)."""
    pending = ""
    while True:
        chunk = file.readline()
        if not chunk:
            time.sleep(FOLLOW_SECONDS)
            continue
        pending += chunk
        if pending.endswith("\n"):
            yield pending
            pending = ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ops.samples", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="the run directory")
    parser.add_argument("--step", type=int, help="only the groups trained in this step")
    parser.add_argument("--follow", action="store_true", help="print new groups until Ctrl-C")
    args = parser.parse_args(argv)
    path = args.out / SAMPLES_FILE
    if not args.out.is_dir():
        print(f"ops.samples: {args.out}: no such run directory", file=sys.stderr)
        return 1
    if not path.exists() and not args.follow:
        print(
            f"ops.samples: {path} does not exist: no group sampled yet, or the run has "
            "report.samples_every 0",
            file=sys.stderr,
        )
        return 1
    try:
        while not path.exists():  # --follow: the job writes it with its first sampled group
            time.sleep(FOLLOW_SECONDS)
        with open(path) as file:
            lines = follow(file) if args.follow else iter(file.readlines())
            for group in groups(lines, args.step):
                print(render(group) + "\n", flush=True)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
