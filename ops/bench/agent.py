"""`python -m ops.bench.agent [--quick]`: the built-in agent task learns to use its tool.

Runs the main job on examples/agent_calc.yaml (`python -m producers.prompts`: embedded
server, local fleet, multi-turn episodes with the calculator in its sandbox; the task is
`producers.agent_tasks`) and reads the run's metrics.jsonl: per step, the mean reward, the
tool-use rate (the share of the step's trained episodes that called a tool at least once,
`consumers.buffer_groups.episode_stats`), the solved rate (the share that solved the task:
the asked expression called and its result copied, reward 1.0) and the mean model turns.
Start and end are means over the first and the last tenth of the steps, as the run's summary
takes the reward (`producers.report.summarize`). ratio = reward at the end / reward at the
start. From the run's samples.jsonl (every `report.samples_every`-th group, the trained ones),
per step: `exact_call` (the share of episodes whose first turn calls exactly the asked
expression), `first_digit` (whose called expression starts with the asked first digit: the
place that lagged, docs/agents.md) and `copy` (of the episodes whose call the calculator
answered with a number, the share whose answer is exactly that number); their start and end
likewise.

Writes agent.png (reward, tool-use rate and solved rate per step) and agent.json in `--out`,
the run directory under it (`job/`), and prints the job's progress, then one JSON object as
the last line. `--set KEY.PATH=VALUE` passes a config override to the job; `--report` runs
nothing and reports the run already in `--out` (a full run is long on loaded cores: one
stopped by SIGTERM still writes its metrics and summary).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engines.tiny_chat import IM_END
from producers.agent_tasks import answer, first_turn, tool_result

ROOT = Path(__file__).resolve().parent.parent.parent
CONFIG = ROOT / "examples" / "agent_calc.yaml"
QUICK_STEPS = 40
"""--quick: RL steps, after a warm start of `QUICK_WARM_START` steps: about 4 minutes on 2 CPU
cores, the calls the warm start taught held (see docs/agents.md)."""
QUICK_WARM_START = 150
"""--quick: the warm start's steps (the example's 300 take minutes on loaded cores); its loss
is near the end of its fall by then (1.13 at 150, 1.10 at 300: the random expression's and its
result's characters, which no demonstration tells)."""


def run_job(steps: int, out: Path, overrides: list[str]) -> dict[str, Any]:
    """The main job on the example for `steps` steps with `overrides` (KEY.PATH=VALUE), its
    progress lines passed through; its summary (the job's last line)."""
    command = [sys.executable, "-m", "producers.prompts", "--config", str(CONFIG), *overrides]
    command += ["--steps", str(steps), "--out", str(out)]
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True) as job:
        assert job.stdout is not None
        lines = []
        for line in job.stdout:
            lines.append(line)
            print(line, end="", flush=True)
    if job.returncode != 0:
        raise SystemExit(f"ops.bench.agent: the job failed (exit {job.returncode})")
    return dict(json.loads(lines[-1]))


def ends(values: list[float]) -> tuple[float, float]:
    """Means over the first and the last tenth of `values` (at least one each)."""
    tenth = max(1, len(values) // 10)
    return sum(values[:tenth]) / tenth, sum(values[-tenth:]) / tenth


_ASKED = re.compile(r"(\d+[*+-]\d+)")
_EXPRESSION = re.compile(r'"expression": "([^"]*)"')


def episode_shares(path: Path) -> list[dict[str, float]]:
    """Per step with samples (ascending), from samples.jsonl at `path` (special tokens kept):
    ``{"step", "exact_call", "first_digit", "copy"}`` (see the module doc)."""
    by_step: dict[int, list[tuple[bool, bool, bool | None]]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        group = json.loads(line)
        asked = _ASKED.findall(group.get("prompt") or "")
        if group.get("step") is None or not asked:
            continue
        for response in group["responses"]:
            text = response["text"].replace(IM_END, "")
            turn = first_turn(text)
            called = _EXPRESSION.search(turn)
            expression = called[1] if called else ""
            result = tool_result(turn)
            copied = None if result is None else answer(text) == result
            row = (expression == asked[-1], expression[:1] == asked[-1][:1], copied)
            by_step.setdefault(group["step"], []).append(row)
    shares = []
    for step, rows in sorted(by_step.items()):
        copies = [c for _, _, c in rows if c is not None]
        shares.append(
            {
                "step": step,
                "exact_call": sum(r[0] for r in rows) / len(rows),
                "first_digit": sum(r[1] for r in rows) / len(rows),
                "copy": sum(copies) / len(copies) if copies else 0.0,
            }
        )
    return shares


def plot(metrics: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [m["reward_mean"] for m in metrics], label="mean reward")
    ax.plot(steps, [m.get("tool_use_rate", 0.0) for m in metrics], label="tool-use rate")
    ax.plot(steps, [m.get("solved_rate", 0.0) for m in metrics], label="solved rate")
    ax.set(xlabel="optimizer step", ylabel="per step", title=title, ylim=(0, 1.05))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figures(
    metrics: list[dict[str, Any]], summary: dict[str, Any], shares: list[dict[str, float]]
) -> dict[str, Any]:
    """The bench's JSON from the run's steps, summary and sampled episodes' shares."""
    sampled = {
        f"{name}_{end}": round(value, 3)
        for name in ("exact_call", "first_digit", "copy")
        for end, value in zip(
            ("start", "end"), ends([s[name] for s in shares] or [0.0]), strict=True
        )
    }
    reward_start, reward_end = ends([m["reward_mean"] for m in metrics])
    tool_start, tool_end = ends([m.get("tool_use_rate", 0.0) for m in metrics])
    turns_start, turns_end = ends([m.get("turns_mean", 0.0) for m in metrics])
    solved_start, solved_end = ends([m.get("solved_rate", 0.0) for m in metrics])
    return {
        "solved_start": round(solved_start, 3),
        "solved_end": round(solved_end, 3),
        "tool_use_start": round(tool_start, 3),
        "tool_use_end": round(tool_end, 3),
        "reward_start": round(reward_start, 3),
        "reward_end": round(reward_end, 3),
        "ratio": round(reward_end / max(reward_start, 1e-6), 3),
        "turns_start": round(turns_start, 3),
        "turns_end": round(turns_end, 3),
        **sampled,
        "steps": len(metrics),
        "samples_trained": summary.get("samples_trained"),
        "seconds": round(float(summary.get("seconds", 0.0)), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.agent", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_STEPS} steps after a warm start of {QUICK_WARM_START} (about 4 minutes) "
        "instead of the example's",
    )
    parser.add_argument("--steps", type=int, help="steps to run (overrides --quick)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="a config override passed to the job (repeatable), e.g. algorithm.entropy_coef=0.01",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="run nothing: the figures and the PNG of the run already in OUT/job (one stopped "
        "for time, say: its metrics.jsonl and summary.json are written on SIGTERM)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where agent.png, agent.json and the run directory go (default: runs/agent-<time>)",
    )
    args = parser.parse_args()
    if args.report and args.out is None:
        parser.error("--report reads the run in --out: name it")
    from schemas.config import load_config

    steps = args.steps or (QUICK_STEPS if args.quick else load_config(CONFIG).trainer.steps)
    out = args.out or ROOT / "runs" / f"agent-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    quick = [f"model.warm_start.steps={QUICK_WARM_START}"] if args.quick else []
    if args.report:
        summary = json.loads((out / "job" / "summary.json").read_text())
    else:
        summary = run_job(steps, out / "job", [*quick, *args.set])
    lines = (out / "job" / "metrics.jsonl").read_text().splitlines()
    metrics = sorted((json.loads(line) for line in lines if line), key=lambda m: m["step"])
    result: dict[str, Any] = {"bench": "agent", "quick": args.quick}
    if not args.report:  # a reported run's overrides are not known here
        result["set"] = args.set
    shares = episode_shares(out / "job" / "samples.jsonl")
    result |= figures(metrics, summary, shares)
    plot(metrics, out / "agent.png", f"calc: reward, tool use and solved over {len(metrics)} steps")
    result["png"] = str(out / "agent.png")
    (out / "agent.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
