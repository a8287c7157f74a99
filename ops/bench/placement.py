"""`python -m ops.bench.placement [--quick] [--out DIR]`: separated, colocated, and separated
with lending.

The same long-tail job as `ops.bench.async_vs_sync` (the simulated engine, 4 slots; the real
tiny-model step plus a simulated cost per trained token; the real bus, reward, buffer, gate and
weight versions), with a simulated device memory on the engine: what it holds awake, and what
giving it back and taking it again cost (`rollout.engine.memory_mib`, `sleep_seconds`,
`wake_seconds`). Runs, each on its own embedded server and one-of-each-role local fleet:

    separated-sync, separated-async   the rollout engine and the trainer on a device each
    colocated-sync, colocated-async   both on one device, in turns (`placement: colocated`,
                                      `bus.lease`): sync is verl's hybrid engine
    separated-async-b1                separated, the rollout worker generating one prompt a
                                      batch (so it holds 2 prompts, not every one admitted)
    separated-lend-async              the same, `lend: true`: the trainer, waiting for its
                                      batches longer than LEND_AFTER, runs rollout on its own
                                      device (`consumers.lending`) and takes the prompts the
                                      rollout worker has not

    run -> the trajectories' generation intervals (the trajectory stream), the steps' train
        intervals (metrics) ->
        wall time from the first generation to the last step's end (the same trained samples),
        each device's busy share (the union of what computed on it over the wall time; with
        lending, the trainer's device: its steps and its lends, from each lend to its
        hand-back as the trainer logs them, `JETRL_PHASE_LOG`),
        device-seconds (wall x devices) -> a timeline PNG, one row per device and role

Last line: JSON with "ratio" = separated wall / the best other wall (the best plain separated
run against the best colocated or lending one), and "device_ratio" = the same in
device-seconds; "lend" = separated-async-b1 wall / the lending run's wall (lending
against its own baseline, not only against the best).

Why one prompt a batch beside lending: with batch admission the rollout worker fetches
twice `max_batch_prompts` prompts, which at 16 is every prompt the gate admits here (2 a step,
max_staleness 1), and leaves nothing on the queue to lend; `separated-async-b1` is its
baseline without lending.

Not measured yet: colocated on two devices (two trainer ranks, each beside a rollout engine:
colocation refuses dp_size > 1 for now).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from consumers.colocation import PHASE_LOG
from ops.bench.async_vs_sync import bench_config, run_one, union
from schemas.config import RunConfig

SLEEP_SECONDS = 0.3
WAKE_SECONDS = 0.3
"""Simulated release and resume costs: a small model's vLLM sleep(level=1) and wake_up."""
LEND_AFTER = 0.2
"""Seconds the lending trainer waits for its batches before it lends (`trainer.lend_after`)."""
RUNS: tuple[tuple[str, str, str, int | None], ...] = (
    ("separated-sync", "separated", "sync", None),
    ("separated-async", "separated", "async", None),
    ("colocated-sync", "colocated", "sync", None),
    ("colocated-async", "colocated", "async", None),
    ("separated-async-b1", "separated", "async", 1),
    ("separated-lend-async", "separated", "async", 1),
)
"""(name, placement, mode, rollout.max_batch_prompts: None, the default); `lend` in the name
lends."""


def placement_config(
    run: str, placement: str, mode: str, steps: int, batch: int | None = None, lend: bool = False
) -> RunConfig:
    """`ops.bench.async_vs_sync`'s workload (async: max_staleness 1) with a simulated device
    memory, `placement` as named; batch admission (what colocation takes), `batch` prompts a
    batch at most; `lend`: the trainer lends its device after `LEND_AFTER` s of waiting."""
    base = bench_config(run, mode, 1, steps)
    engine = base.rollout.engine.model_copy(
        update={"memory_mib": 1024.0, "sleep_seconds": SLEEP_SECONDS, "wake_seconds": WAKE_SECONDS}
    )
    rollout = base.rollout.model_copy(update={"engine": engine, "continuous": False})
    if batch is not None:
        rollout = rollout.model_copy(update={"max_batch_prompts": batch})
    data = base.model_dump() | {"placement": placement, "rollout": rollout.model_dump()}
    if lend:
        data |= {"lend": True, "trainer": data["trainer"] | {"lend_after": LEND_AFTER}}
    return RunConfig.model_validate(data)


def lent_intervals(phases: Path) -> list[tuple[float, float]]:
    """(lend, hand-back) times of the trainer's lends (`consumers.lending`'s phase lines)."""
    if not phases.exists():
        return []
    lines = [json.loads(line) for line in phases.read_text().splitlines()]
    lends = [line for line in lines if line["phase"] == "lend"]
    starts = [float(line["t"]) for line in lends if line["event"] == "start"]
    ends = [float(line["t"]) for line in lends if line["event"] == "end"]
    return list(zip(starts, ends, strict=False))


def busy(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of the union of `intervals` inside [start, end]."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in union(intervals))


def measure(
    name: str, placement: str, mode: str, steps: int, tmp: Path, batch: int | None = None
) -> dict:
    out = tmp / name
    lend = "lend" in name
    phases = out / "phases.jsonl"
    os.environ[PHASE_LOG] = str(phases)  # the fleet's workers inherit it
    try:
        result = run_one(
            placement_config(f"bench-{name}", placement, mode, steps, batch, lend), out
        )
    finally:
        del os.environ[PHASE_LOG]
    timeline = result["timeline"]
    # The trainer's device lent: from each lend to its hand-back, as the trainer logged them
    # (a lent sample's own generate time also counts the steps it was paused through).
    timeline["lent"] = lent_intervals(phases)
    start, wall = timeline["start"], result["wall_seconds"]
    end = start + wall
    rollout, trainer, lent = timeline["rollout"], timeline["trainer"], timeline["lent"]
    if placement == "separated":
        devices = {
            "device 0 (rollout)": busy(rollout, start, end) / wall,
            "device 1 (trainer)": busy([*trainer, *lent], start, end) / wall,
        }
    else:
        devices = {"device 0 (both)": busy([*rollout, *trainer], start, end) / wall}
    return {
        "wall_seconds": round(wall, 2),
        "samples": result["samples"],
        "devices": len(devices),
        "device_seconds": round(wall * len(devices), 2),
        "busy_share": {d: round(share, 3) for d, share in devices.items()},
        "staleness_max_seen": result["staleness_max_seen"],
        "lent_share": round(busy(lent, start, end) / wall, 3),
        "timeline": timeline,
    }


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.4 * len(results) + 1), sharex=True)
    for ax, (name, r) in zip(axes, results.items(), strict=False):
        t0 = r["timeline"]["start"]
        other = 1 if r["devices"] == 2 else 0
        rows = [("rollout", 0, "tab:blue"), ("lent", other, "tab:green")]
        rows += [("trainer", other, "tab:orange")]  # over the lent spans: it took them back
        for who, row, colour in rows:
            spans = [(s - t0, e - s) for s, e in union(r["timeline"][who])]
            ax.broken_barh(spans, (row - 0.4, 0.8), color=colour, label=who)
        ax.set_yticks(range(r["devices"]), [f"device {d}" for d in range(r["devices"])])
        ax.set_ylim(-0.6, 1.6)
        ax.set_title(
            f"{name}: {r['wall_seconds']:.1f} s, busy {r['busy_share']}", fontsize=8, loc="left"
        )
    axes[0].legend(loc="upper right", fontsize=7)
    axes[-1].set_xlabel(
        "seconds since the first generation "
        "(blue: rollout, orange: trainer, green: the trainer's lent rollout)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.placement", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="4 steps a run instead of 16")
    parser.add_argument(
        "--out", type=Path, default=None, help="where placement.json and .png go (default: cwd)"
    )
    args = parser.parse_args()
    steps = 4 if args.quick else 16
    out_dir = args.out or Path.cwd()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, placement, mode, batch in RUNS:
            results[name] = measure(name, placement, mode, steps, Path(tmp), batch)
            shown = {k: v for k, v in results[name].items() if k != "timeline"}
            print(f"{name}: {json.dumps(shown)}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(results, out_dir / "placement.png")
    plain = [n for n in results if n.startswith("separated") and "lend" not in n]
    separated = min(plain, key=wall_of(results))
    other = min((n for n in results if n not in plain), key=wall_of(results))
    figures = {
        "bench": "placement",
        "quick": args.quick,
        "steps": steps,
        "sleep_seconds": SLEEP_SECONDS,
        "wake_seconds": WAKE_SECONDS,
        "runs": {n: {k: v for k, v in r.items() if k != "timeline"} for n, r in results.items()},
        "best_separated": separated,
        "best_other": other,
        "ratio": round(results[separated]["wall_seconds"] / results[other]["wall_seconds"], 3),
        "lend": round(
            results["separated-async-b1"]["wall_seconds"]
            / results["separated-lend-async"]["wall_seconds"],
            3,
        ),
        "device_ratio": round(
            results[separated]["device_seconds"] / results[other]["device_seconds"], 3
        ),
    }
    (out_dir / "placement.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))


def wall_of(results: dict[str, dict]) -> Callable[[str], float]:
    return lambda name: results[name]["wall_seconds"]


if __name__ == "__main__":
    main()
