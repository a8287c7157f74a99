"""The main job around the gate: an embedded server and a local fleet (or a cluster's URL), the
live progress line, stopping on a signal, and the summary and report at the end.

    run:      [embedded nats-server + local fleet of trainer, buffer, (reference,) reward,
              rollout] -> produce
    produce:  config to KV -> one TaskGroup: gate.Producer watch + feed, membership heartbeat,
              fleet check, signals; a progress line every 2 s until the trainer's last step
              (or SIGINT/SIGTERM: Stopped; a loop beside it fails: its error) -> summary, plots
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from bus import metrics
from bus.connection import connect
from bus.election import ride_out
from bus.embedded import EmbeddedNats
from bus.lag import queue_lag
from bus.runtime import Runtime, attach, publish_config
from bus.security import USERS_FILE, write_identities
from bus.tasks import cancel_until_done
from bus.topology import Topology
from consumers.fleet_config import local_fleet
from consumers.supervisor import Supervisor
from producers import report
from producers.gate import Producer
from producers.stall import StallWatch
from schemas.config import RunConfig

log = logging.getLogger("jetrl.producer")
PROGRESS_SECONDS = 2.0
"""Seconds between progress lines."""


class Stopped(Exception):
    """SIGINT or SIGTERM reached the main job after `steps` trained steps."""

    def __init__(self, signal_name: str, steps: int | None) -> None:
        super().__init__(f"stopped by {signal_name}")
        self.signal_name, self.steps = signal_name, steps
        """Steps trained when it came; None before the run was watched (starting up)."""


def stop_on_sigterm(signum: int, _frame: object) -> None:
    """Until the run's loop takes SIGTERM over: stop as Ctrl-C would, through the clean-ups."""
    raise Stopped(signal.Signals(signum).name, None)


async def lag(rt: Runtime) -> str:
    """Each work queue's pending + in-flight count; `?` for one the server cannot say now
    (its stream is electing a leader, say): a display must not stop the run."""
    parts = []
    for role, lag in (await queue_lag(rt.js, rt.topology)).items():
        if lag is None:
            parts.append(f"{role} ?")
            continue
        metrics.set_queue_depth(role, lag.pending, lag.in_flight)
        parts.append(f"{role} {lag.pending}+{lag.in_flight}")
    return " ".join(parts)


async def progress(producer: Producer, started: float, every: float = PROGRESS_SECONDS) -> None:
    """One line every `every` seconds until the last step's metrics arrive; once no step came for
    `trainer.stall_after` seconds, it ends with who holds the work and why (`producers.stall`)."""
    steps = producer.cfg.trainer.steps
    stall = StallWatch(producer.cfg.trainer.stall_after, since=started)
    while len(producer.metrics) < steps:
        await asyncio.sleep(every)
        done = sorted(producer.metrics.values(), key=lambda m: m["step"])
        recent = done[-5:]
        reward = sum(m["reward_mean"] for m in recent) / len(recent) if recent else float("nan")
        samples = sum(m["samples"] for m in done)
        elapsed = time.time() - started
        print(
            f"[{elapsed:6.0f}s] step {len(done):>4}/{steps}  reward {reward:.3f}  "
            f"staleness<={max((m['staleness_max'] for m in recent), default=0)}  "
            f"{samples / elapsed:6.1f} samples/s  weights v{producer.version}  dropped "
            f"{len(producer.dropped)}  lag(pending+in flight) {await lag(producer.rt)}  "
            f"{await stall.check(producer)}".rstrip(),
            flush=True,
        )


async def produce(
    cfg: RunConfig,
    url: str,
    out: Path,
    fleet: Supervisor | None,
    replicas: int = 1,
    identity: Path | None = None,
) -> dict:
    """Feed and watch a run until its last step; return the summary. Stopped on SIGINT/SIGTERM.

    The progress line runs until the last step's metrics arrive; the gate's loops, the
    membership heartbeat, the fleet's check and the signal watch run beside it in one
    TaskGroup, so any of them that fails ends the job with its error (not a silent hang)."""
    started = time.time()
    received: list[str] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):

        def on_signal(name: str = sig.name) -> None:
            received.append(name)
            stop.set()

        loop.add_signal_handler(sig, on_signal)
    rt = await attach_bootstrap(cfg, url, replicas, identity)
    producer = Producer(rt)

    async def stopped() -> None:
        await stop.wait()
        raise Stopped(received[0], len(producer.metrics))

    beside = {
        "gate feed": producer.feed(),
        "gate watch": producer.watch(),
        "membership heartbeat": rt.member.beat(),
        "signals": stopped(),
    }
    if fleet is not None:
        beside["fleet"] = watch_fleet(fleet)
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(coro, name=name) for name, coro in beside.items()]
            await progress(producer, started)
            await cancel_until_done(tasks)  # one mid-request can swallow one cancel
    except BaseExceptionGroup as failed:
        raise first_cause(failed) from None
    finally:
        await rt.close()
    summary = summarize(cfg, producer, started)
    report.write(out, [producer.metrics[s] for s in sorted(producer.metrics)], summary)
    return summary


async def watch_fleet(fleet: Supervisor, every: float = 0.5) -> None:
    """Restart the fleet's workers that died (`Supervisor.check` raises if one cannot be)."""
    while True:
        fleet.check()
        await asyncio.sleep(every)


def first_cause(failed: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to report from a failed TaskGroup: a stop by signal first, else the first."""
    leaves = list(_leaves(failed))
    return next((exc for exc in leaves if isinstance(exc, Stopped)), leaves[0])


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def summarize(cfg: RunConfig, producer: Producer, started: float) -> dict:
    """The run in one JSON object: steps, samples, reward at the start and the end (means over
    the first and last tenth of the steps), staleness, drops, throughput."""
    steps = [producer.metrics[s] for s in sorted(producer.metrics)]
    tenth = max(1, len(steps) // 10)
    first, last = steps[:tenth], steps[-tenth:]
    seconds = time.time() - started
    samples = sum(m["samples"] for m in steps)
    return {
        "run": cfg.run,
        "started_at": started,
        "seconds": seconds,
        "steps": len(steps),
        "samples_trained": samples,
        "reward_start": sum(m["reward_mean"] for m in first) / len(first),
        "reward_end": sum(m["reward_mean"] for m in last) / len(last),
        "max_staleness": cfg.staleness.bound,
        "staleness_max_seen": max(m["staleness_max"] for m in steps),
        "groups_dropped": len(producer.dropped),
        "samples_per_s": samples / seconds,
    }


async def attach_bootstrap(
    cfg: RunConfig, url: str, replicas: int = 1, identity: Path | None = None
) -> Runtime:
    """The producer owns the config: it writes it to KV before attaching like any worker."""
    nc = await connect(url, "producer-bootstrap", identity=identity)
    js = nc.jetstream()
    topology = Topology.for_config(cfg, replicas)
    await ride_out(lambda: topology.apply(js), f"declaring run {cfg.run}")
    kv = await ride_out(lambda: js.key_value(topology.kv_bucket), "opening the run's KV bucket")
    await ride_out(lambda: publish_config(kv, cfg), "writing the run config")
    await nc.close()
    return await attach(
        "producer", cfg.run, url, replicas, beat_in_background=False, identity=identity
    )


def prepare(cfg: RunConfig, out: Path) -> RunConfig:
    """Resolve what the local job fills in: the built-in model (or a relative model directory,
    made absolute), the checkpoint directory and the weights directory (`weights.dir`,
    absolute: workers may run from another directory)."""
    updates: dict = {}
    if cfg.model.path is None:
        # Imported here: torch and transformers take seconds,
        # and a cluster's producer never needs them.
        from engines.tiny import build_tiny_model
        from producers.tasks import VOCAB

        model_dir = out / "model"
        if not (model_dir / "config.json").exists():
            build_tiny_model(
                model_dir,
                VOCAB,
                hidden=cfg.model.hidden,
                layers=cfg.model.layers,
                seed=cfg.model.seed,
            )
        updates["model"] = cfg.model.model_copy(update={"path": str(model_dir.resolve())})
    elif Path(cfg.model.path).is_dir() and not Path(cfg.model.path).is_absolute():
        # A relative directory here, absolute for the workers
        # (a hub id is left for each to resolve).
        updates["model"] = cfg.model.model_copy(
            update={"path": str(Path(cfg.model.path).resolve())}
        )
    if not cfg.trainer.checkpoint_dir:
        updates["trainer"] = cfg.trainer.model_copy(
            update={"checkpoint_dir": str((out / "checkpoints").resolve())}
        )
    if not Path(cfg.weights.dir).is_absolute():
        weights_dir = Path(cfg.weights.dir) if cfg.weights.dir else out / "weights"
        updates["weights"] = cfg.weights.model_copy(update={"dir": str(weights_dir.resolve())})
    return cfg.model_copy(update=updates)


def run(cfg: RunConfig, out: Path, nats: str | None = None, replicas: int = 1) -> dict:
    """The run against the cluster at `nats`, or on an embedded server with a local fleet (both
    stopped on the way out, whatever ends the run); its summary."""
    if nats:
        return asyncio.run(produce(cfg, nats, out, None, replicas))
    with contextlib.ExitStack() as stack:
        # Per-run, per-role identities: the server knows their public keys only, each worker
        # reads its own seed file, and a local process without one cannot publish into the run.
        identities = out / "identities"
        seeds = write_identities(Topology(run=cfg.run), identities)
        users = (identities / USERS_FILE).read_text()
        server = stack.enter_context(EmbeddedNats(out / "nats", extra_config=users))
        reference = cfg.reference.workers if cfg.reference.enabled else 0
        fleet = Supervisor(
            local_fleet(out / "logs", cfg.trainer.ranks, reference),
            cfg.run,
            server.url,
            identities=identities,
        )
        fleet.start()
        stack.callback(fleet.stop)
        return asyncio.run(produce(cfg, server.url, out, fleet, identity=seeds["producer"]))
