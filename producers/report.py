"""The end of a run: metrics JSONL, a summary JSON and PNG plots next to them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def write(out: Path, metrics: list[dict[str, Any]], summary: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as f:
        for m in metrics:
            f.write(json.dumps({k: v for k, v in m.items() if k != "sample_ids"}) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if not metrics:
        return []
    steps = [m["step"] for m in metrics]
    t0 = summary["started_at"]
    elapsed = [m["time"] - t0 for m in metrics]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        steps,
        [m["reward_mean"] for m in metrics],
        marker=".",
        label="mean reward of the step's batch",
    )
    ax.set(
        xlabel="optimizer step",
        ylabel="reward",
        title=f"run {summary['run']}: reward",
        ylim=(0, 1.05),
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=110)

    hist: list[int] = []
    for m in metrics:
        for staleness, count in enumerate(m["staleness_hist"]):
            hist += [0] * (staleness + 1 - len(hist))
            hist[staleness] += count
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(range(len(hist)), hist)
    ax.set(
        xlabel="staleness (versions behind the trained step)",
        ylabel="response tokens",
        title=f"token staleness (max allowed {summary['max_staleness']})",
        xticks=range(len(hist)),
    )
    fig.tight_layout()
    fig.savefig(out / "staleness.png", dpi=110)

    fig, ax = plt.subplots(figsize=(7, 4))
    rates = [
        m["samples"] / max(b - a, 1e-6)
        for m, a, b in zip(metrics[1:], elapsed, elapsed[1:], strict=False)
    ]
    ax.plot(elapsed[1:], rates, marker=".")
    ax.set(xlabel="seconds since start", ylabel="trained samples / s", title="throughput")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close("all")
    return [out / "reward.png", out / "staleness.png", out / "throughput.png"]
