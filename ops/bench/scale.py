"""`python -m ops.bench.scale [--quick] [--out DIR]`: what one 3-node NATS cluster and our
stages hold as the rollout fleet grows (issue 29, docs/scale.md).

    a 3-node JetStream cluster on loopback (`bus.embedded.EmbeddedCluster`, what
    `ops.cluster` writes), streams and buckets at 3 replicas -> per N (10, 100, 1,000;
    --quick: 10, 100), a run of its own on it:
        the producer and its gate (`producers.launcher.produce`), one trainer (real, its
        step's cost simulated: `trainer.engine: simulated`), one buffer, reward workers
        (real), and N simulated rollout workers as asyncio tasks in a few processes
        (`ops.bench.scale_workers`): each its own membership heartbeat, pull requests,
        in_progress heartbeats, weights reader and loss guard
        + a probe (`ops.bench.scale_probe`) sampling the servers, streams and queues each second
    -> per N, over the steps after the warm-up: samples trained per second, server CPU per
       1k messages/s, queue lag, KV writes/s, announcement-to-loaded time of weight versions,
       ack windows hit, pull requests refused, the first limit that breaks
    -> scale.json and scale.png (samples/s and lag against N) in --out

The per-worker rate is fixed: each worker generates one prompt's n = 2 samples (8 tokens
each, 2 slots) per `--seconds-per-batch` T, so N workers make 2N/T samples/s; the batch grows
with the fleet (prompts_per_step = N, the step time stays T, as docs/scale.md assumes), and the
trainer's step is simulated at T/4 whatever N (a data-parallel trainer growing with the fleet):
no optimizer step computed, a cost per token that shrinks with N. At the full run's T = 20 s,
N = 1,000 asks for 100 samples/s; everything (three servers, the fleet, the producer, the
probe) shares this machine's cores, so the machine's load is printed with the figures.

Last line: JSON with "ratio" = (samples/s at the largest N / samples/s at N = 10) /
(largest N / 10): 1.0 is linear scaling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from bus.connection import connect
from bus.embedded import EmbeddedCluster
from bus.topology import Topology
from consumers.fleet_config import FleetConfig, RoleConfig
from consumers.supervisor import Supervisor
from ops.bench.scale_probe import QUEUES, Probe, Sample
from producers.launcher import prepare, produce
from schemas.config import RunConfig, parse_config

TOKENS = 8
"""Response tokens of every simulated sample (sigma 0: no tail, the rate stays fixed)."""
SAMPLES_PER_PROMPT = 2
REPLICAS = 3
WARM_STEPS = 2
"""Steps left out of the figures: the fleet joining, the first weight versions."""
EFFICIENT = 0.8
"""A fleet size whose samples/s falls below this share of N x the per-worker rate has broken
a limit."""


def scale_config(run: str, workers: int, seconds_per_batch: float, steps: int) -> RunConfig:
    """N = `workers` simulated workers' run: N prompts a step, n = 2, async (max_staleness 1:
    the gate lets 2N prompts out, two per worker, what each one holds: one generating, one
    waiting)."""
    step_tokens = workers * SAMPLES_PER_PROMPT * TOKENS
    return parse_config(
        {
            "run": run,
            "mode": "async",
            "algorithm": {
                "prompts_per_step": workers,
                "max_staleness": 1,
                "drop_equal_reward_groups": False,
            },
            "data": {"n": SAMPLES_PER_PROMPT, "sampling": {"max_tokens": 2 * TOKENS}},
            # No real step: its cost would grow with N on these cores (engines.simulated_train).
            "trainer": {
                "engine": "simulated",
                "steps": steps,
                "checkpoint_every": 100_000,
                "simulated_seconds_per_token": seconds_per_batch / 4 / step_tokens,
            },
            "rollout": {
                "engine": {
                    "type": "simulated",
                    "median_tokens": TOKENS,
                    "sigma": 0.0,
                    "seconds_per_token": seconds_per_batch / TOKENS,
                    "slots": SAMPLES_PER_PROMPT,
                },
                "max_batch_prompts": 1,
                "continuous": False,
            },
            # A file per version, read with mmap: the object store would fan N copies of
            # every version out through the servers (docs/scale.md, "Weights").
            "weights": {"transport": "filesystem"},
        },
        f"bench {run}",
    )


def processes_for(workers: int) -> int:
    """Rollout processes: about 250 simulated workers each, at most 4 (the machine's cores are
    shared by everything)."""
    return min(4, max(1, math.ceil(workers / 250)))


def scale_fleet(workers: int, logs: Path) -> FleetConfig:
    replicas = ["--replicas", str(REPLICAS)]
    procs = processes_for(workers)
    return FleetConfig(
        roles={
            "trainer": RoleConfig(args=replicas),
            "buffer": RoleConfig(args=replicas),
            "reward": RoleConfig(processes=1 + workers // 500, args=replicas),
            "rollout": RoleConfig(
                processes=procs,
                module="ops.bench.scale_workers",
                args=[*replicas, "--workers", str(workers // procs)],
            ),
        },
        logs=logs,
    )


def fleet_pids(fleet: Supervisor) -> dict[str, list[int]]:
    pids: dict[str, list[int]] = {}
    for name, child in fleet.children.items():
        if child.proc is not None and child.proc.poll() is None:
            pids.setdefault(name.rsplit("-", 1)[0], []).append(child.proc.pid)
    return pids


async def job(cfg: RunConfig, cluster: EmbeddedCluster, out: Path, fleet: Supervisor) -> Probe:
    """The run to its last step, probed from beside it."""
    nc = await connect(cluster.url, "bench-scale-probe")
    try:
        probe = Probe(nc, Topology.for_config(cfg, REPLICAS), cluster, lambda: fleet_pids(fleet))
        # The producer's progress lines go to a file: stdout ends with the figures.
        with open(out / "progress.log", "w") as progress, contextlib.redirect_stdout(progress):
            async with asyncio.TaskGroup() as group:
                probing = group.create_task(probe.run())
                try:
                    await produce(cfg, cluster.url, out, fleet, REPLICAS)
                finally:
                    probing.cancel()
        return probe
    finally:
        await nc.close()


async def delete_run(cfg: RunConfig, url: str) -> None:
    """The run's streams and buckets, once its fleet has stopped: the next N starts clean."""
    nc = await connect(url, "bench-scale-cleanup")
    try:
        await Topology.for_config(cfg, REPLICAS).delete(nc.jetstream())
    finally:
        await nc.close()


def between(samples: list[Sample], start: float, end: float) -> tuple[Sample, Sample]:
    """The first sample at or after `start` and the last at or before `end`."""
    inside = [s for s in samples if start <= s.time <= end] or samples[-2:]
    return inside[0], inside[-1]


def refused_pulls(logs: Path) -> dict[str, int]:
    """Pull requests the servers refused at once (a 409), by the server's reason, from the
    workers' logs (`bus.worker` logs each): "Exceeded MaxWaiting" is the window of waiting
    requests; others (a leadership change) come with the cluster's elections."""
    reasons = Counter(
        reason.strip()
        for log in logs.glob("*.log")
        for reason in re.findall(r"pull refused: 409 ([^\n]*)", log.read_text(errors="replace"))
    )
    return dict(reasons)


def figures(cfg: RunConfig, workers: int, probe: Probe, out: Path, rate: float) -> dict:
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps.sort(key=lambda m: m["step"])
    start, end = steps[WARM_STEPS - 1]["time"], steps[-1]["time"]
    seconds = end - start
    trained = (len(steps) - WARM_STEPS) * cfg.algorithm.prompts_per_step * cfg.data.n
    first, last = between(probe.samples, start, end)
    span = max(last.time - first.time, 1e-9)
    msgs = last.server_msgs - first.server_msgs
    server_cpu = last.server_cpu - first.server_cpu
    window = [s for s in probe.samples if first.time <= s.time <= last.time]
    queues = {}
    for channel in QUEUES:
        seen = [s.queues[channel.name] for s in window]
        most = max(q.ack_pending for q in seen)
        queues[channel.work_queue.durable] = {
            "pending_mean": round(statistics.fmean(q.pending for q in seen), 1),
            "pending_max": max(q.pending for q in seen),
            "ack_pending_max": most,
            "max_ack_pending": seen[-1].max_ack_pending,
            "window_hit": most >= seen[-1].max_ack_pending,
            "waiting_max": max(q.waiting for q in seen),
        }
    reach = [t for v, t in probe.reach.seconds().items() if v >= WARM_STEPS - 1]
    samples_per_s = trained / seconds
    return {
        "workers": workers,
        "rollout_processes": processes_for(workers),
        "samples_per_s": round(samples_per_s, 2),
        "generated_per_s": round((last.trajectories - first.trajectories) / span, 2),
        "target_per_s": round(workers * rate, 2),
        "efficiency": round(samples_per_s / (workers * rate), 3),
        "step_seconds": round(seconds / (len(steps) - WARM_STEPS), 2),
        "target_step_seconds": round(SAMPLES_PER_PROMPT / rate, 2),
        "server_msgs_per_s": round(msgs / span, 1),
        "server_cores": round(server_cpu / span, 3),
        "server_cores_per_1k_msgs_per_s": round(server_cpu / max(msgs / 1000, 1e-9), 3),
        "fleet_cores": {
            role: round((last.fleet_cpu.get(role, 0) - first.fleet_cpu.get(role, 0)) / span, 3)
            for role in last.fleet_cpu
        },
        "member_kv_writes_per_s": round((last.member_writes - first.member_writes) / span, 1),
        "run_kv_writes_per_s": round((last.kv_writes - first.kv_writes) / span, 1),
        "lag": queues,
        "weights_reach_s": {
            "versions": len(reach),
            "median": round(statistics.median(reach), 3) if reach else None,
            "max": round(max(reach), 3) if reach else None,
        },
        "refused_pulls": refused_pulls(out / "logs"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def first_limit(run: dict) -> str | None:
    """The first limit this fleet size broke, in the order they stop a run: a work queue's
    ack window full, pull requests refused, weights slower than a step, then throughput."""
    for durable, queue in run["lag"].items():
        if queue["window_hit"]:
            return f"{durable} max_ack_pending {queue['max_ack_pending']} full"
    if waiting := run["refused_pulls"].get("Exceeded MaxWaiting"):
        return f"{waiting} pull requests refused: Exceeded MaxWaiting"
    reach = run["weights_reach_s"]["median"]
    # A worker loads a version once its running batch ends (half a step on average): a median
    # past the step the per-worker rate asks for holds the gate, which admits by version.
    if reach is not None and reach > run["target_step_seconds"]:
        return (
            f"weight versions reach every worker in {reach} s (median), more than the "
            f"{run['target_step_seconds']:g} s step the rate asks for"
        )
    if run["efficiency"] < EFFICIENT:
        busy = sum(run["fleet_cores"].values()) + run["server_cores"]
        return (
            f"throughput {run['efficiency']:.0%} of the target: {busy:.2f} cores busy "
            f"(server {run['server_cores']:.2f}), load average {run['load_average'][0]}"
        )
    return None


def measure(
    workers: int,
    seconds_per_batch: float,
    steps: int,
    cluster: EmbeddedCluster,
    model: Path | None,
    tmp: Path,
) -> dict:
    out = tmp / f"n{workers}"
    out.mkdir(parents=True)
    cfg = scale_config(f"scale-{workers}", workers, seconds_per_batch, steps)
    if model is not None:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(model)})})
    cfg = prepare(cfg, out)
    fleet = Supervisor(scale_fleet(workers, out / "logs"), cfg.run, cluster.url)
    fleet.start()
    try:
        probe = asyncio.run(job(cfg, cluster, out, fleet))
    finally:
        fleet.stop()
        asyncio.run(delete_run(cfg, cluster.url))
    rate = SAMPLES_PER_PROMPT / seconds_per_batch
    found = figures(cfg, workers, probe, out, rate)
    found["first_limit"] = first_limit(found)
    found["model"] = cfg.model.path
    return found


def plot(runs: dict[int, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(sizes, [runs[n]["samples_per_s"] for n in sizes], "o-", label="trained")
    left.plot(sizes, [runs[n]["generated_per_s"] for n in sizes], "s--", label="generated")
    left.plot(sizes, [runs[n]["target_per_s"] for n in sizes], ":", color="grey", label="N x rate")
    left.set(xscale="log", yscale="log", xlabel="rollout workers N", ylabel="samples/s")
    left.legend(fontsize=8)
    for durable in runs[sizes[0]]["lag"]:
        right.plot(
            sizes,
            [runs[n]["lag"][durable]["pending_mean"] + 0.1 for n in sizes],
            "o-",
            label=f"{durable} (mean)",
        )
    right.set(
        xscale="log",
        yscale="log",
        xlabel="rollout workers N",
        ylabel="messages pending delivery (+0.1)",
    )
    right.legend(fontsize=8)
    fig.suptitle("ops.bench.scale: one 3-node cluster on this machine", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.scale", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="N = 10 and 100, T = 4 s, 5 steps (a smoke run, about 2 minutes)",
    )
    parser.add_argument("--sizes", type=int, nargs="+", help="fleet sizes (default 10 100 1000)")
    parser.add_argument("--seconds-per-batch", type=float, help="T (default 20; --quick 4)")
    parser.add_argument("--steps", type=int, help="steps a run (default 8; --quick 5)")
    parser.add_argument(
        "--out", type=Path, default=None, help="where scale.json and scale.png go (default: cwd)"
    )
    args = parser.parse_args()
    sizes = args.sizes or ([10, 100] if args.quick else [10, 100, 1000])
    if 10 not in sizes or any(n < 1 for n in sizes):
        parser.error(f"--sizes must include 10 (the ratio's base) and be positive, got {sizes}")
    seconds = args.seconds_per_batch or (4.0 if args.quick else 20.0)
    steps = args.steps or (5 if args.quick else 8)
    if steps <= WARM_STEPS + 1:
        parser.error(f"--steps must be more than {WARM_STEPS + 1}, got {steps}")
    out_dir = args.out or Path.cwd()
    runs: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedCluster(Path(tmp) / "nats") as cluster:
        model = None
        for n in sorted(sizes):
            runs[n] = measure(n, seconds, steps, cluster, model, Path(tmp))
            model = Path(runs[n].pop("model"))
            print(f"N={n}: {json.dumps(runs[n])}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(runs, out_dir / "scale.png")
    largest = max(runs)
    limits = {n: r["first_limit"] for n, r in runs.items() if r["first_limit"]}
    result = {
        "bench": "scale",
        "quick": args.quick,
        "seconds_per_batch": seconds,
        "per_worker_samples_per_s": SAMPLES_PER_PROMPT / seconds,
        "steps": steps,
        "runs": runs,
        "first_limit": next(iter(limits.values()), None),
        "first_limit_at": next(iter(limits), None),
        "ratio": round(
            runs[largest]["samples_per_s"] / runs[10]["samples_per_s"] / (largest / 10), 3
        ),
    }
    (out_dir / "scale.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
