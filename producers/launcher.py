"""The main job around the gate: an embedded server and a local fleet (or a cluster's URL), the
live progress line, stopping on a signal, and the summary and report at the end.

    run:      [embedded nats-server + local fleet of trainer, buffer, (reference,) reward,
              rollout] -> produce
    produce:  config to KV -> one TaskGroup: gate.Producer watch + feed, membership heartbeat,
              fleet check, signals, samples.jsonl (`producers.samples`); a progress line every
              2 s until the trainer's last step (or SIGINT/SIGTERM: Stopped; a loop beside it
              fails: its error) -> summary, plots: written however it ends (`producers.report`)

The local job's run directory holds `server.json` while its server runs (`bus.run_dir`): the
operator's tools find the run's port and admin identity there (`ops.status --out DIR`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from bus import metrics
from bus.connection import connect
from bus.election import ride_out
from bus.embedded import EmbeddedNats
from bus.lag import queue_lag
from bus.membership import live_members
from bus.run_dir import SERVER_FILE, write_server
from bus.runtime import Runtime, attach, publish_config
from bus.security import USERS_FILE, write_identities
from bus.tasks import cancel_until_done, recancelled
from bus.topology import Topology
from consumers.fleet_config import local_fleet
from consumers.supervisor import FleetFailed, Supervisor
from producers import datasets, report
from producers.gate import Producer
from producers.samples import SamplesWriter
from producers.stall import UNREADABLE, StallWatch
from producers.startup import all_ready, expected_workers, starting_line
from schemas.config import AGENT_TASKS, RunConfig
from schemas.model_config import WARM_START_REPORT, ModelConfig

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


async def live_roles(rt: Runtime) -> Counter[str] | None:
    """Live workers by role; None when the bus cannot say now."""
    try:
        return Counter(m.role for m in await live_members(rt.js, rt.topology))
    except UNREADABLE:
        return None


async def progress(producer: Producer, started: float, every: float = PROGRESS_SECONDS) -> None:
    """One line every `every` seconds until the last step's metrics arrive; until this process's
    first step, which workers are up (`producers.startup`); once no step came for
    `trainer.stall_after` seconds, it ends with who holds the work and why (`producers.stall`).
    The rate counts the steps trained since `started` only (`report.rate_since`)."""
    steps = producer.cfg.trainer.steps
    stall = StallWatch(producer.cfg.trainer.stall_after, since=started)
    expected = expected_workers(producer.cfg)
    while len(producer.metrics) < steps:
        await asyncio.sleep(every)
        done = sorted(producer.metrics.values(), key=lambda m: m["step"])
        now = time.time()
        elapsed = now - started
        stepped = any(m["time"] >= started for m in done)
        live = None if stepped else await live_roles(producer.rt)
        if not stepped and not all_ready(live, expected):
            line = starting_line(live, expected)
            if producer.dropped:
                line += f"  dropped {producer.drops.breakdown()}"
            print(f"[{elapsed:6.0f}s] {line}  {await stall.check(producer)}".rstrip(), flush=True)
            continue
        recent = done[-5:]
        reward = sum(m["reward_mean"] for m in recent) / len(recent) if recent else float("nan")
        print(
            f"[{elapsed:6.0f}s] step {len(done):>4}/{steps}  reward {reward:.3f}  "
            f"staleness<={max((m['staleness_max'] for m in recent), default=0)}  "
            f"{report.rate_since(done, started, now):6.1f} samples/s  weights "
            f"v{producer.version}  dropped {producer.drops.breakdown()}  "
            f"lag(pending+in flight) {await lag(producer.rt)}  "
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
    samples = SamplesWriter(producer, out)

    async def stopped() -> None:
        await stop.wait()
        raise Stopped(received[0], len(producer.metrics))

    beside = {
        "gate feed": producer.feed(),
        "gate watch": producer.watch(),
        "membership heartbeat": rt.member.beat(),
        "signals": stopped(),
        "samples": samples.follow(),
    }
    if fleet is not None:
        beside["fleet"] = watch_fleet(fleet)
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(recancelled(coro, name), name=name)
                for name, coro in beside.items()
            ]
            await recancelled(progress(producer, started), "progress")
            await cancel_until_done(tasks)  # one mid-request can swallow one cancel
    except BaseExceptionGroup as failed:
        cause = first_cause(failed)
        # Stopped, stalled or failed: the run directory keeps what the run got to.
        write_report(cfg, producer, samples, out, started, cause)
        raise cause from None
    finally:
        await rt.close()
    return write_report(cfg, producer, samples, out, started)


def write_report(
    cfg: RunConfig,
    producer: Producer,
    samples: SamplesWriter,
    out: Path,
    started: float,
    ending: BaseException | None = None,
) -> dict:
    """metrics.jsonl, summary.json, the plots and the last samples for what the run got to
    (`producers.report`); the summary. Ending on an error (`ending`), a failure here is only
    logged: the error that ended the run is the one to report."""
    try:
        samples.flush(pending=ending is None)
        return report.write(
            out,
            producer.metrics.values(),
            run=cfg.run,
            started=started,
            now=time.time(),
            max_staleness=cfg.staleness.bound,
            dropped=len(producer.dropped),
            drops=producer.drops.as_json(),
        )
    except Exception:
        if ending is None:
            raise
        log.exception("the run's report could not be written after %r", ending)
        return {}


async def watch_fleet(fleet: Supervisor, every: float = 0.5) -> None:
    """Restart the fleet's workers that died; `Supervisor.check` raises FleetFailed once one
    cannot be: every failing worker's one-line reason, the root cause first."""
    while True:
        fleet.check()
        await asyncio.sleep(every)


def first_cause(failed: BaseExceptionGroup[BaseException]) -> BaseException:
    """The error to report from a failed TaskGroup: a stop by signal first, then the fleet's
    failure (FleetFailed: its workers' reasons, root cause first, explain a loop's error beside
    it), else the first."""
    leaves = list(_leaves(failed))
    for kind in (Stopped, FleetFailed):
        found = next((exc for exc in leaves if isinstance(exc, kind)), None)
        if found is not None:
            return found
    return leaves[0]


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


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
    made absolute), a relative dataset file made absolute, the checkpoint directory and the
    weights directory (`weights.dir`, absolute: workers may run from another directory)."""
    updates: dict = {}
    if cfg.model.path is None:
        model_dir = out / "model"
        if not (model_dir / "config.json").exists():
            build_builtin_model(cfg, model_dir)
        updates["model"] = cfg.model.model_copy(update={"path": str(model_dir.resolve())})
    elif Path(cfg.model.path).exists() and not Path(cfg.model.path).is_absolute():
        # A relative directory (or .gguf file) here, absolute for the workers
        # (a hub id is left for each to resolve).
        updates["model"] = cfg.model.model_copy(
            update={"path": str(Path(cfg.model.path).resolve())}
        )
    if cfg.model.warm_start is not None:
        model = updates.get("model", cfg.model)
        target = out / "model"
        if not (target / WARM_START_REPORT).exists():  # else done: a resumed run
            warm_start_model(cfg, model, target)
        updates["model"] = model.model_copy(update={"path": str(target.resolve())})
    if cfg.data.dataset and not Path(cfg.data.dataset).is_absolute():
        # A relative file here, absolute for a resumed run started elsewhere.
        dataset = str(Path(cfg.data.dataset).expanduser().resolve())
        updates["data"] = cfg.data.model_copy(update={"dataset": dataset})
    if not cfg.trainer.checkpoint_dir:
        updates["trainer"] = cfg.trainer.model_copy(
            update={"checkpoint_dir": str((out / "checkpoints").resolve())}
        )
    if not Path(cfg.weights.dir).is_absolute():
        weights_dir = Path(cfg.weights.dir) if cfg.weights.dir else out / "weights"
        updates["weights"] = cfg.weights.model_copy(update={"dir": str(weights_dir.resolve())})
    return cfg.model_copy(update=updates)


def warm_start_model(cfg: RunConfig, model: ModelConfig, target: Path) -> None:
    """`model.warm_start` (`engines.warm_start`) from `model`'s checkpoint into `target`, in a
    child process: the model, its gradients and AdamW's moments (6 GB resident for a 135M model,
    measured) go with it instead of staying in the producer for the whole run."""
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    try:
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            pool.submit(_warm_start, cfg, model, target).result()
    except Exception as exc:  # a bad demonstration, a model that cannot load, a killed child
        cause = " ".join(str(exc).split()) or "the warm start's process died"
        raise WarmStartFailed(f"model.warm_start: {type(exc).__name__}: {cause}") from exc


class WarmStartFailed(Exception):
    """The warm start could not finish; the message is one line naming the cause."""


def _warm_start(cfg: RunConfig, model: ModelConfig, target: Path) -> None:
    """The child's work: the tools shown as the episodes show them; progress on the console."""
    warm = cfg.model.warm_start
    assert warm is not None
    # Imported here, as for the built-in model: torch and transformers take seconds.
    from engines.model_source import resolve_model_path
    from engines.tools import load_tools
    from engines.warm_start import warm_start

    tools = load_tools(cfg.agent.tools) if cfg.agent else {}
    report = warm_start(
        resolve_model_path(model.path, model.revision),
        target,
        datasets.demonstrations(warm, cfg.data),
        [tool.schema for tool in tools.values()],
        steps=warm.steps,
        lr=warm.lr,
        batch=warm.batch,
        seed=cfg.model.seed,
        progress=lambda line: print(line, flush=True),
    )
    print(
        f"warm start: loss {report.loss_start:.3f} -> {report.loss_end:.3f} over {report.steps} "
        f"steps in {report.seconds:.0f}s; the run trains {target}",
        flush=True,
    )


def build_builtin_model(cfg: RunConfig, model_dir: Path) -> None:
    """The tiny random-init model into `model_dir`: with the chat tokenizer of
    `engines.tiny_chat` for an agent task (calc), else the digits tasks' tokenizer."""
    # Imported here: torch and transformers take seconds,
    # and a cluster's producer never needs them.
    if cfg.data.dataset is None and cfg.data.task in AGENT_TASKS:
        from engines.tiny_chat import build_tiny_chat_model

        build_tiny_chat_model(
            model_dir, hidden=cfg.model.hidden, layers=cfg.model.layers, seed=cfg.model.seed
        )
        return
    from engines.tiny import build_tiny_model
    from producers.tasks import VOCAB

    build_tiny_model(
        model_dir, VOCAB, hidden=cfg.model.hidden, layers=cfg.model.layers, seed=cfg.model.seed
    )


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
        # ops.status --out finds the run here (bus.run_dir); gone with the server.
        write_server(out, cfg.run, server.url, seeds["admin"])
        stack.callback((out / SERVER_FILE).unlink, missing_ok=True)
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
