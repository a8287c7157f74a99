"""The run directory's record of a run: metrics JSONL, a summary JSON and PNG plots.

Written whenever the main job ends, whether the run finished, was stopped (SIGINT/SIGTERM, a
stall) or failed, with what it got to. A resume (`--out` an existing run directory) extends
them: each process of the run is one *segment*,

    metrics.jsonl   one line per step, appended: a step already in the file is kept as it is
    summary.json    the run over every step in the file; `segments` lists each process's start,
                    seconds and the samples it trained, and the rates count only those
    reward.png, staleness.png, throughput.png   drawn again from the whole file

A rate is samples trained *by this process* over this process's seconds (`rate_since`): the
steps read back from an earlier segment are not its work. `throughput.png` shows the rate
between consecutive steps faintly and a rolling rate over `SMOOTH_STEPS` steps on top; a
resume breaks both lines instead of bridging the downtime.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SMOOTH_STEPS = 10
"""Steps the smoothed throughput is taken over."""


def rate_since(metrics: Iterable[dict[str, Any]], since: float, now: float) -> float:
    """Samples per second trained from `since` to `now`: only the steps recorded at or after
    `since` count (a resumed run's earlier steps are not this process's work)."""
    samples = sum(m["samples"] for m in metrics if m["time"] >= since)
    return samples / max(now - since, 1e-6)


def read_metrics(out: Path) -> list[dict[str, Any]]:
    """The steps already in the run directory's metrics.jsonl (none if there is no file)."""
    path = out / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_metrics(out: Path, metrics: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Append the steps of `metrics` that metrics.jsonl lacks; every step of the file after,
    in step order."""
    out.mkdir(parents=True, exist_ok=True)
    old = read_metrics(out)
    have = {m["step"] for m in old}
    new = [
        {k: v for k, v in m.items() if k != "sample_ids"}
        for m in sorted(metrics, key=lambda m: m["step"])
        if m["step"] not in have
    ]
    with open(out / METRICS_FILE, "a") as f:
        for m in new:
            f.write(json.dumps(m) + "\n")
    return sorted(old + new, key=lambda m: m["step"])


def segment(started: float, now: float, metrics: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """This process's part of the run: when it started, its seconds, the samples it trained."""
    mine = [m for m in metrics if m["time"] >= started]
    return {
        "started_at": started,
        "seconds": now - started,
        "steps_trained": len(mine),
        "samples_trained": sum(m["samples"] for m in mine),
    }


def summarize(
    run: str,
    max_staleness: int,
    dropped: int,
    metrics: list[dict[str, Any]],
    segments: list[dict[str, Any]],
    drops: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run in one JSON object over every step recorded: steps, samples, reward at the start
    and the end (means over the first and last tenth of the steps), staleness, drops (by kind,
    and the reward failures by reason: `producers.drops.DropTally.as_json`); the throughput over
    the segments' own work and seconds."""
    tenth = max(1, len(metrics) // 10)
    first, last = metrics[:tenth], metrics[-tenth:]
    seconds = sum(s["seconds"] for s in segments)
    samples = sum(s["samples_trained"] for s in segments)

    def mean(ms: list[dict[str, Any]]) -> float | None:
        return sum(m["reward_mean"] for m in ms) / len(ms) if ms else None

    return {
        "run": run,
        "started_at": segments[0]["started_at"],
        "seconds": seconds,
        "steps": len(metrics),
        "samples_trained": sum(m["samples"] for m in metrics),
        "reward_start": mean(first),
        "reward_end": mean(last),
        "max_staleness": max_staleness,
        "staleness_max_seen": max((m["staleness_max"] for m in metrics), default=0),
        "groups_dropped": dropped,
        "drops": drops or {},
        "samples_per_s": samples / max(seconds, 1e-6),
        "segments": segments,
    }


def earlier_segments(out: Path) -> list[dict[str, Any]]:
    """The segments summary.json records from earlier processes of this run (none if new)."""
    path = out / SUMMARY_FILE
    if not path.exists():
        return []
    try:
        return list(json.loads(path.read_text()).get("segments", []))
    except (json.JSONDecodeError, AttributeError):
        return []


def write(
    out: Path,
    metrics: Iterable[dict[str, Any]],
    *,
    run: str,
    started: float,
    now: float,
    max_staleness: int,
    dropped: int,
    drops: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Extend the run directory's record with this process's steps; the summary written."""
    metrics = list(metrics)
    segments = [*earlier_segments(out), segment(started, now, metrics)]
    every = append_metrics(out, metrics)
    summary = summarize(run, max_staleness, dropped, every, segments, drops)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if every:
        plot(out, every, summary)
    return summary


def step_rates(
    metrics: list[dict[str, Any]], starts: list[float]
) -> list[tuple[float, float, float]]:
    """(time, samples, seconds) between consecutive steps in time order, leaving out each pair
    that a segment start falls between (the downtime of a resume, the start-up after it)."""
    ordered = sorted(metrics, key=lambda m: m["time"])
    pairs = []
    for a, b in zip(ordered, ordered[1:], strict=False):
        if any(a["time"] < s <= b["time"] for s in starts):
            continue
        pairs.append((b["time"], float(b["samples"]), max(b["time"] - a["time"], 1e-6)))
    return pairs


def smoothed(pairs: list[tuple[float, float, float]], window: int) -> list[float]:
    """Rolling rate: samples over seconds of the last `window` pairs (a pair's own rate at 1)."""
    rates = []
    for i in range(len(pairs)):
        recent = pairs[max(0, i - window + 1) : i + 1]
        rates.append(sum(p[1] for p in recent) / sum(p[2] for p in recent))
    return rates


def plot(out: Path, metrics: list[dict[str, Any]], summary: dict[str, Any]) -> list[Path]:
    steps = [m["step"] for m in metrics]
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
    starts = [s["started_at"] for s in summary["segments"]]
    origin = summary["started_at"]
    for lo, hi in zip(starts, [*starts[1:], float("inf")], strict=True):
        pairs = [p for p in step_rates(metrics, starts) if lo <= p[0] < hi]
        if not pairs:
            continue
        x = [p[0] - origin for p in pairs]
        first = lo == starts[0]
        ax.plot(
            x,
            [p[1] / p[2] for p in pairs],
            color="tab:blue",
            alpha=0.25,
            linewidth=0.8,
            label="between consecutive steps" if first else None,
        )
        ax.plot(
            x,
            smoothed(pairs, SMOOTH_STEPS),
            color="tab:blue",
            linewidth=2,
            label=f"over {SMOOTH_STEPS} steps" if first else None,
        )
    ax.set(xlabel="seconds since the run started", ylabel="trained samples / s", title="throughput")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close("all")
    return [out / "reward.png", out / "staleness.png", out / "throughput.png"]
