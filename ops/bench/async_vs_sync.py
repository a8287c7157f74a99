"""`python -m ops.bench.async_vs_sync [--quick] [--simulated-only] [--out DIR]`:
the async speedup, against our own sync mode.

Runs the same job four times on the same fleet shape (one trainer, buffer, reward worker and
rollout worker; embedded server): `mode: sync`, then `mode: async` with max_staleness 1, 2
and 4. Rollout is the simulated engine (`engines.simulated`, scheduling studies only) with
long-tail log-normal lengths and 4 slots per trainer; the trainer adds a simulated cost per
token trained (`trainer.simulated_seconds_per_token`) to its real tiny-model step; everything
between them (bus, reward, buffer, gate, weight versions) is the real machinery.

Per run: wall time from the first generation's start to the last step's end (the same
number of trained samples in every run; start-up is left out), and the time the rollout
worker and the trainer each sat idle in it (rollout busy = the union of its generations,
read back from the trajectory stream; trainer busy = its steps). A timeline PNG shows both.
Then the real-model part: the built-in job (examples/digits.yaml: the tiny Qwen2, the HF
engine, the digits task) in the same four modes. Per run, the step rewards smoothed over a
window of a tenth of the steps; the target is the sync run's final smoothed reward, and each
run's figure is the wall time at which its smoothed reward first reaches it
(`--simulated-only` leaves this part out).

Last line: JSON with "ratio" = sync wall / best async wall (simulated part) and
"real_ratio" = the sync run's time to the target / the best async run's (null when no async
run reached it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.topology import TRAJECTORIES, Topology
from consumers.fleet_config import local_fleet
from consumers.supervisor import Supervisor
from ops.audit import replay_events
from producers.launcher import prepare, produce
from schemas import Trajectories
from schemas.config import RunConfig, parse_config, read_yaml

SLOTS = 4
BUILTIN = Path(__file__).resolve().parent.parent.parent / "examples" / "digits.yaml"
MODES: tuple[tuple[str, int], ...] = (("sync", 0), ("async", 1), ("async", 2), ("async", 4))


def bench_config(run: str, mode: str, staleness: int, steps: int) -> RunConfig:
    """The long-tail workload: 2 prompts x 4 samples a step on 4 slots, lengths log-normal with
    median 3 and sigma 1.8 capped at 56 (the tiny model's context is 64 with the prompt; about
    5% of samples reach the cap), 20 ms a token; training 3 ms a token on top of the real step,
    about the tokens' generation time on the 4 slots."""
    algorithm: dict = {"prompts_per_step": 2, "drop_equal_reward_groups": False}
    if mode == "async":
        algorithm["max_staleness"] = staleness
    return parse_config(
        {
            "run": run,
            "mode": mode,
            "algorithm": algorithm,
            "data": {"n": 4, "sampling": {"max_tokens": 56}},
            "trainer": {
                "steps": steps,
                "checkpoint_every": 1000,
                "simulated_seconds_per_token": 0.003,
            },
            "rollout": {
                "engine": {
                    "type": "simulated",
                    "median_tokens": 3,
                    "sigma": 1.8,
                    "seconds_per_token": 0.02,
                    "slots": SLOTS,
                }
            },
            # The bench replays the run's trajectories afterwards: keep them once scored.
            "streams": {"consumed": "keep"},
        },
        f"bench {run}",
    )


def real_config(run: str, mode: str, staleness: int, steps: int) -> RunConfig:
    """The built-in job, its model, engine and task, in `mode` for `steps` steps."""
    data = read_yaml(BUILTIN)
    assert isinstance(data, dict), f"{BUILTIN}: not a mapping"
    data["run"], data["mode"] = run, mode
    data["trainer"] = {**data.get("trainer", {}), "steps": steps, "checkpoint_every": 100_000}
    algorithm = {k: v for k, v in data.get("algorithm", {}).items() if k != "max_staleness"}
    data["algorithm"] = algorithm | ({"max_staleness": staleness} if mode == "async" else {})
    data["streams"] = {**data.get("streams", {}), "consumed": "keep"}  # replayed afterwards
    return parse_config(data, f"bench {run}")


def smoothed(rewards: list[float], window: int) -> list[float]:
    """The mean of the last `window` step rewards at each step (fewer at the start)."""
    return [
        sum(rewards[max(0, i + 1 - window) : i + 1]) / (i + 1 - max(0, i + 1 - window))
        for i in range(len(rewards))
    ]


def time_to(result: dict, target: float, window: int) -> float | None:
    """Seconds from the run's first generation to the end of the first step whose smoothed
    reward reaches `target`; None if none does."""
    for end, reward in zip(result["step_ends"], smoothed(result["rewards"], window), strict=False):
        if reward >= target - 1e-9:
            return end - result["timeline"]["start"]
    return None


async def generations(url: str, run: str) -> dict[str, list[tuple[float, float]]]:
    """(start, end) of each trajectory's generation, from the trajectory stream, by the role
    that generated it (`rollout`; `trainer` for a trainer's lent rollout, `lend: true`)."""
    nc = await connect(url, "bench-async-vs-sync")
    try:
        stored: list[Trajectories] = await replay_events(
            nc.jetstream(), Topology(run=run), TRAJECTORIES
        )
    finally:
        await nc.close()
    by_role: dict[str, set[tuple[float, float]]] = {}
    events = [t for event in stored for t in event.each()]  # a group's event holds n
    for t in events:  # source: host:pid:role
        by_role.setdefault(t.source.rsplit(":", 1)[-1], set()).add(
            (t.time - t.timings["generate"], t.time)
        )
    return {role: sorted(spans) for role, spans in by_role.items()}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def run_one(cfg: RunConfig, out: Path) -> dict:
    """One job on its own embedded server and local fleet; its figures and busy intervals."""
    cfg = prepare(cfg, out)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(EmbeddedNats(out / "nats"))
        fleet = Supervisor(local_fleet(out / "logs", 1), cfg.run, server.url)
        fleet.start()
        stack.callback(fleet.stop)
        summary = asyncio.run(produce(cfg, server.url, out, fleet))
        by_role = asyncio.run(generations(server.url, cfg.run))
        rollout = union(by_role.get("rollout", []))
        lent = union(by_role.get("trainer", []))
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps.sort(key=lambda m: m["step"])
    trainer = [(m["time"] - m["train_seconds"], m["time"]) for m in steps]
    start, end = min(s for s, _ in rollout + lent), max(e for _, e in trainer)
    wall = end - start
    return {
        "wall_seconds": wall,
        "samples": summary["samples_trained"],
        "rollout_idle_seconds": wall - sum(e - s for s, e in rollout),
        "trainer_idle_seconds": wall - sum(e - s for s, e in trainer),
        "staleness_max_seen": summary["staleness_max_seen"],
        "timeline": {"start": start, "rollout": rollout, "trainer": trainer, "lent": lent},
        "rewards": [m["reward_mean"] for m in steps],
        "step_ends": [m["time"] for m in steps],
    }


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(results), 1, figsize=(11, 1.3 * len(results) + 1), sharex=True, squeeze=False
    )
    for ax, (name, result) in zip(axes[:, 0], results.items(), strict=False):
        t0 = result["timeline"]["start"]
        for row, (who, colour) in enumerate((("rollout", "tab:blue"), ("trainer", "tab:orange"))):
            spans = [(s - t0, e - s) for s, e in result["timeline"][who]]
            ax.broken_barh(spans, (row - 0.4, 0.8), color=colour)
        ax.set_yticks([0, 1], ["rollout", "trainer"])
        ax.set_title(f"{name}: {result['wall_seconds']:.1f} s", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds since the first generation")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_modes(
    config: Callable[[str, str, int, int], RunConfig], part: str, steps: int, tmp: Path
) -> dict[str, dict]:
    """The job `config` makes, once per mode; each run's figures printed as it ends."""
    results: dict[str, dict] = {}
    for mode, staleness in MODES:
        name = "sync" if mode == "sync" else f"async-{staleness}"
        results[name] = run_one(
            config(f"bench-{part}-{name}", mode, staleness, steps), tmp / f"{part}-{name}"
        )
        shown = {
            k: round(v, 2) if isinstance(v, float) else v
            for k, v in results[name].items()
            if k not in ("timeline", "rewards", "step_ends")
        }
        print(f"{part} {name}: {json.dumps(shown)}", flush=True)
    return results


def real_figures(results: dict[str, dict], steps: int) -> dict:
    """Each run's time to the sync run's final smoothed reward, and real_ratio."""
    window = max(1, steps // 10)
    target = smoothed(results["sync"]["rewards"], window)[-1]
    reached = {name: time_to(result, target, window) for name, result in results.items()}
    asyncs = [t for name, t in reached.items() if name != "sync" and t is not None]
    sync_time = reached["sync"]
    return {
        "target_reward": round(target, 4),
        "window_steps": window,
        "runs": {
            name: {
                "wall_seconds": round(r["wall_seconds"], 2),
                "final_reward": round(smoothed(r["rewards"], window)[-1], 4),
                "seconds_to_target": None if (t := reached[name]) is None else round(t, 2),
            }
            for name, r in results.items()
        },
        "real_ratio": round(sync_time / min(asyncs), 3) if asyncs and sync_time else None,
    }


def summarize(results: dict[str, dict]) -> dict:
    return {
        n: {
            k: round(v, 2) if isinstance(v, float) else v
            for k, v in r.items()
            if k not in ("timeline", "rewards", "step_ends")
        }
        for n, r in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.async_vs_sync", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="4 simulated and 60 real steps a run instead of 16 and 300 (about 4 minutes)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="where async_vs_sync.json and .png go (default: cwd)"
    )
    parser.add_argument(
        "--simulated-only",
        action="store_true",
        help="leave out the real-model part (real_ratio null): a scheduling study alone",
    )
    args = parser.parse_args()
    steps, real_steps = (4, 60) if args.quick else (16, 300)
    out_dir = args.out or Path.cwd()
    with tempfile.TemporaryDirectory() as tmp:
        simulated = run_modes(bench_config, "simulated", steps, Path(tmp))
        real = {} if args.simulated_only else run_modes(real_config, "real", real_steps, Path(tmp))
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(simulated, out_dir / "async_vs_sync.png")
    if real:
        plot(real, out_dir / "async_vs_sync_real.png")
    best = min((n for n in simulated if n != "sync"), key=lambda n: simulated[n]["wall_seconds"])
    real_part = real_figures(real, real_steps) if real else {"real_ratio": None}
    figures = {
        "bench": "async_vs_sync",
        "quick": args.quick,
        "steps": steps,
        "slots": SLOTS,
        "runs": summarize(simulated),
        "best_async": best,
        "real": {"steps": real_steps, **real_part, "summary": summarize(real)} if real else None,
        "ratio": round(simulated["sync"]["wall_seconds"] / simulated[best]["wall_seconds"], 3),
        "real_ratio": real_part["real_ratio"],
    }
    (out_dir / "async_vs_sync.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
