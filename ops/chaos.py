"""`python -m ops.chaos [--quick] [--runs N] [--seed S] [--out DIR]`: kill -9 every kind of process mid-work, then audit.

Each run is the built-in job (`examples/digits.yaml`, shortened) against an embedded
nats-server this tool owns, every process of it — the producer too, with `--nats URL --out
DIR` — supervised by `consumers.fleet.Supervisor`, which restarts what dies. During a run
one process of each kind is SIGKILLed, in a random order, each a random few trainer steps
after the replacement of the one killed before did its first work, at a moment read from the
run's own traffic:

    producer mid-publish     as a prompt is published (the gate opens for a step's worth
                             of prompts at a time: the producer is inside that burst)
    rollout mid-generation   30-80 ms after a prompt is published (fetched, batched, generating)
    reward mid-scoring       0-20 ms after a trajectory is published (its group is being scored)
    buffer mid-batch         as the first micro-batch of a step is published (the step's other
                             micro-batches and the acks of its samples are under way)
    trainer mid-step         within one step's train time after the previous step's metrics
    trainer mid-checkpoint   while the checkpoint is written: its temporary file is seen after
                             the metrics of a step that checkpoints

Then the fleet is stopped and the run is accounted for from the streams (`ops.audit`) and
from the trainer's final checkpoint:

    issued      prompt ids stored in the prompt stream
    trained     issued prompts with a sample inside a stored BatchEvent
    dropped     issued prompts with a `drop.<prompt id>` record in the run's KV (the reason)
    held        issued prompts neither trained nor dropped that a work queue still holds at
                shutdown: a message of theirs (the prompt, a trajectory, a reward) that the
                queue reading it never had acked. Legitimately in flight: the stream
                delivers it again to the next worker.
    lost        issued - trained - dropped - held: prompts nothing will ever finish
    duplicates  sample ids inside more than one stored batch, plus sample ids more than once
                in the final checkpoint's update history (`trained`)
    staleness_violations  loss tokens trained at step s made by weights older than s - max_staleness
    restart     kill -> the replacement process joined the run (its membership entry)
    recovery    kill -> the replacement's first output: a prompt, trajectory, reward or batch
                event whose `source` is its worker id; for the trainer, a step beyond the last
                one before the kill (so after retraining the steps since its checkpoint). The
                work the victim held comes back after ack_wait, and a step waiting for it
                stalls the run (a rollout's replacement gets no new prompt until then).

The run's work queues are declared with `ack_wait` = ACK_WAIT s (60-120 s by default): the
messages a killed worker held come back only after ack_wait, and a whole step waits for them.

Prints a table per run, then as its last line one JSON object: totals of the figures above,
`recovery_s` and `restart_s` per fault (median, max), and `ratio`: the median over the runs
of steps/s with kills / steps/s of an uninterrupted run of the same config just before it
(both from first to last step, so start-up is left out; pairs, because other work on the
machine changes the pace over minutes). --quick skips the uninterrupted runs: `ratio` null.
Exits 1 if a run did not finish or lost, duplicated or over-staled anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.topology import Topology
from consumers.fleet import POLL_SECONDS, ROLES, FleetConfig, RoleConfig, Supervisor
from consumers.membership import live_members
from ops.audit import audit
from producers.prompts import BUILTIN
from schemas import BatchEvent, DecodeError, PromptEvent, decode
from schemas.config import load_config

ACK_WAIT = 10.0
"""Seconds before a killed worker's unacked messages are redelivered (see the module doc)."""
MICRO_BATCH_TOKENS = 256
"""Small enough that a step is several micro-batches, so a buffer kill can land between them."""
CHECKPOINT_WAIT = 1.0
"""Seconds the mid-checkpoint trigger looks for the checkpoint's temporary file."""


@dataclass(frozen=True)
class Profile:
    """How long a run is and how far apart its kills are."""

    steps: int
    checkpoint_every: int
    gap: tuple[int, int]
    """Trainer steps between a recovery and the next kill: a random number in this range."""
    timeout: float
    """Seconds a run may take before it is stopped and counted as unfinished."""
    baseline: bool
    """Run each run once without kills first, for `ratio`."""


QUICK = Profile(steps=40, checkpoint_every=4, gap=(1, 3), timeout=240.0, baseline=False)
FULL = Profile(steps=100, checkpoint_every=5, gap=(2, 6), timeout=1200.0, baseline=True)


@dataclass
class Kill:
    """One SIGKILL and what followed it."""

    fault: str
    step: int
    """The last step the trainer had written when the kill came."""
    note: str
    """What the victim was doing, as far as the bus shows it."""
    at: float
    restart_s: float | None = None
    recovery_s: float | None = None


@dataclass
class Outcome:
    """One run's figures."""

    run: str
    finished: bool
    error: str
    steps_per_s: float
    seconds: float
    accounts: dict[str, Any]
    kills: list[Kill] = field(default_factory=list)


class Monitor:
    """What the driver sees of a run: every message published on its subjects (a core
    subscription sees each as it is sent), and when each trainer step's metrics first appeared."""

    def __init__(self, nc: Client, topology: Topology) -> None:
        self.nc, self.topology = nc, topology
        self.steps: dict[int, float] = {}
        self.waiters: list[tuple[str, Callable[[bytes], bool], asyncio.Future[bytes]]] = []
        self.subs: list[Subscription] = []

    async def start(self) -> None:
        t = self.topology
        subjects = {
            "prompts": t.subject("prompts"), "trajectories": t.subject("trajectories"),
            "rewards": t.subject("rewards"), "batches": t.subject("batches", ">"),
            "metrics": f"$KV.{t.kv_bucket}.metrics.0.>",
        }
        self.subs = [await self.nc.subscribe(subject, cb=partial(self._seen, kind)) for kind, subject in subjects.items()]

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()

    async def _seen(self, kind: str, msg: Msg) -> None:
        if kind == "metrics":
            self.steps.setdefault(json.loads(msg.data)["step"], time.time())
        for waiter in [w for w in self.waiters if w[0] == kind and w[1](msg.data)]:
            self.waiters.remove(waiter)
            if not waiter[2].done():
                waiter[2].set_result(msg.data)

    def next(self, kind: str, accept: Callable[[bytes], bool] = lambda _: True) -> asyncio.Future[bytes]:
        """The next message of `kind` that `accept`s (registered now, before any await)."""
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiters.append((kind, accept, future))
        return future

    @property
    def last_step(self) -> int:
        return max(self.steps, default=-1)

    async def step_reached(self, step: int) -> None:
        while self.last_step < step:
            await self.next("metrics")

    def steps_per_s(self) -> float:
        """Steps from the first to the last step's metrics, per second (start-up left out)."""
        times = sorted(self.steps.values())
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def is_first_micro_batch(data: bytes) -> bool:
    try:
        return decode(data, BatchEvent).micro_index == 0
    except DecodeError:
        return False


def first_output(kind: str, killed: int, step: int) -> Callable[[bytes], bool]:
    """Whether a message of `kind` is work of the replacement of process `killed`.

    An event's `source` is its writer's worker id, `host:pid:role`; the trainer's metrics
    carry none, and only a replacement writes a step beyond `step`, the last before the kill.
    """

    def accept(data: bytes) -> bool:
        if kind == "metrics":
            return json.loads(data)["step"] > step
        try:
            return decode(data).source.rsplit(":", 2)[1] != str(killed)
        except DecodeError:
            return False

    return accept


class ChaosRun:
    """One run: its fleet (producer included), the kills, and its accounts."""

    def __init__(self, url: str, nc: Client, out: Path, run: str, profile: Profile, rng: random.Random) -> None:
        self.nc, self.js, self.out, self.profile, self.rng = nc, nc.jetstream(), out, profile, rng
        self.topology = Topology(run=run)
        self.monitor = Monitor(nc, self.topology)
        self.checkpoints = (out / "checkpoints").resolve()
        producer = RoleConfig(module="producers.prompts", args=["--config", str(self.write_config()), "--out", str(out)])
        fleet = FleetConfig(roles={"producer": producer, **{role: RoleConfig() for role in ROLES}}, logs=out / "logs")
        self.fleet = Supervisor(fleet, run, url)
        self.kills: list[Kill] = []

    def write_config(self) -> Path:
        """The built-in config, shortened, checkpointing often, with small micro-batches."""
        config = load_config(BUILTIN).model_dump(mode="json")
        config["run"] = self.topology.run
        config["trainer"].update(
            steps=self.profile.steps, checkpoint_every=self.profile.checkpoint_every,
            micro_batch_tokens=MICRO_BATCH_TOKENS, checkpoint_dir=str(self.checkpoints),
        )
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    async def declare(self) -> None:
        """Declare the run before any of its processes does, its work queues with ACK_WAIT."""
        await self.topology.apply(self.js)
        for queue in self.topology.queues.values():
            short = self.topology.consumer_config(dataclasses.replace(queue, ack_wait=ACK_WAIT))
            await self.js.add_consumer(self.topology.stream(queue.stage), short)

    async def execute(self, kill: bool) -> Outcome:
        """Run to the end (or the timeout), killing if `kill`; stop the fleet; account."""
        await self.declare()
        await self.monitor.start()
        started = time.time()
        self.fleet.start()
        driver = asyncio.create_task(self.drive(list(FAULTS) if kill else []))
        error = ""
        try:
            finished = await self.supervise(time.monotonic() + self.profile.timeout)
        except RuntimeError as exc:  # a worker given up on: the reason's first line says which
            finished, error = False, str(exc).splitlines()[0]
        finally:
            driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver  # re-raises a driver's own failure
            self.fleet.stop()
            await self.monitor.stop()
        seconds = time.time() - started
        return Outcome(self.topology.run, finished, error, self.monitor.steps_per_s(), seconds,
                       await self.account(), self.kills)

    async def supervise(self, deadline: float) -> bool:
        """Keep the fleet up until the producer and the trainer are done (True) or the deadline (False)."""
        while time.monotonic() < deadline:
            self.fleet.check()
            if all(self.fleet.children[name].state == "done" for name in ("producer-0", "trainer-0")):
                return True
            await asyncio.sleep(POLL_SECONDS)
        return False

    async def drive(self, faults: list[str]) -> None:
        """Each fault once, in a random order, a random gap of steps after the last recovery."""
        for name in self.rng.sample(faults, len(faults)):
            target = self.monitor.last_step + self.rng.randint(*self.profile.gap)
            if target > self.profile.steps - 3:
                return  # no room left for a kill and its recovery
            await self.monitor.step_reached(target)
            fault = FAULTS[name]
            await self.strike(name, fault, await fault.trigger(self))

    async def strike(self, name: str, fault: Fault, note: str) -> None:
        """SIGKILL the fault's worker now; wait for its replacement to join and to do its first work."""
        pid = self.fleet.pid(fault.worker)
        if pid is None:
            return  # it has just finished (the trainer after its last step)
        kill = Kill(name, self.monitor.last_step, note, time.time())
        self.kills.append(kill)
        self.fleet.kill(fault.worker)
        output = self.monitor.next(fault.output, first_output(fault.output, pid, kill.step))
        role = fault.worker.rsplit("-", 1)[0]
        if role in self.topology.queues:  # what it held stays unacked until ACK_WAIT: look now
            kill.note = ", ".join(filter(None, (note, await self.holding(role))))
        kill.restart_s = await self.rejoined(fault.worker, pid) - kill.at
        await output
        kill.recovery_s = time.time() - kill.at

    async def rejoined(self, worker: str, killed: int) -> float:
        """Unix time the killed worker's replacement joined the run (its membership entry's start)."""
        role = worker.rsplit("-", 1)[0]
        while True:
            pid = self.fleet.pid(worker)
            if pid not in (None, killed):
                for member in await live_members(self.js, self.topology):
                    if member.role == role and member.pid == pid:
                        return member.started_at
            await asyncio.sleep(POLL_SECONDS)

    # Triggers: each returns at the moment to kill, with a note on what the victim is doing.

    async def mid_publish(self) -> str:
        prompt = decode(await self.monitor.next("prompts"), PromptEvent)
        return f"after publishing {prompt.id}"

    async def mid_generation(self) -> str:
        await self.monitor.next("prompts")
        await asyncio.sleep(self.rng.uniform(0.03, 0.08))
        return ""

    async def mid_scoring(self) -> str:
        await self.monitor.next("trajectories")
        await asyncio.sleep(self.rng.uniform(0.0, 0.02))
        return ""

    async def mid_batch(self) -> str:
        batch = decode(await self.monitor.next("batches", is_first_micro_batch), BatchEvent)
        return f"step {batch.step}: micro-batch 1 of {batch.micro_count} sent"

    async def mid_step(self) -> str:
        metrics = json.loads(await self.monitor.next("metrics"))
        await asyncio.sleep(self.rng.uniform(0.0, metrics["train_seconds"]))
        return f"after step {metrics['step']}"

    async def mid_checkpoint(self) -> str:
        every = self.profile.checkpoint_every
        data = await self.monitor.next("metrics", lambda d: (json.loads(d)["step"] + 1) % every == 0)
        # The temporary file engines.torch_train._atomic_save writes before renaming it over
        # `rank0.pt` (the trainer's checkpoint path): while it exists, the write is under way.
        partial_file = self.checkpoints / f".rank0.pt.tmp-{self.fleet.pid('trainer-0')}"
        deadline = time.monotonic() + CHECKPOINT_WAIT
        while not partial_file.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        where = "mid-write" if partial_file.exists() else "write not seen"
        return f"checkpoint of step {json.loads(data)['step']}: {where}"

    async def holding(self, role: str) -> str:
        queue = self.topology.queues[role]
        info = await self.js.consumer_info(self.topology.stream(queue.stage), queue.durable)
        return f"held {info.num_ack_pending} unacked"

    # Accounts.

    async def account(self) -> dict[str, Any]:
        """The audit of the streams, plus what the module doc defines: held, lost, duplicates."""
        max_staleness = load_config(self.out / "config.yaml").algorithm.max_staleness
        found = await audit(self.js, self.topology, max_staleness)
        candidates = set(found.pop("in_flight_ids"))
        held = await self.held(candidates) if candidates else set()
        history = self.trained_history()
        history_duplicates = len(history) - len(set(history))
        return {
            **{k: found[k] for k in ("issued", "trained", "dropped", "steps", "samples_trained", "staleness_violations")},
            "held": len(held),
            "lost": len(candidates - held),
            "duplicates": found["duplicates"] + history_duplicates,
            "stream_duplicates": found["duplicates"],
            "history_duplicates": history_duplicates,
            "history_samples": len(history),
            "drop_reasons": found["drop_reasons"],
        }

    async def held(self, candidates: set[str]) -> set[str]:
        """Of the `candidates` (prompt ids), those with a message some work queue never had acked.

        The fleet is stopped, so every unacked message comes to us: at once if it was never
        delivered, after ack_wait if a worker held it when it stopped. Ours are left unacked.
        """
        found: set[str] = set()
        for queue in self.topology.queues.values():
            sub = await self.js.pull_subscribe_bind(queue.durable, stream=self.topology.stream(queue.stage))
            info = await sub.consumer_info()
            unacked = (info.num_pending or 0) + (info.num_ack_pending or 0)
            sequences: set[int] = set()
            deadline = time.monotonic() + ACK_WAIT + 5
            while len(sequences) < unacked and (left := deadline - time.monotonic()) > 0:
                with contextlib.suppress(TimeoutError):
                    for msg in await sub.fetch(unacked - len(sequences), timeout=left):
                        sequences.add(msg.metadata.sequence.stream)
                        # Event ids: a prompt's, or `<prompt id>/<sample>` for its trajectories and rewards.
                        event_id = (msg.headers or {}).get("Nats-Msg-Id", "")
                        found.add(event_id if queue.stage == "prompts" else event_id.rsplit("/", 1)[0])
            await sub.unsubscribe()
        return found & candidates

    def trained_history(self) -> list[str]:
        """The final checkpoint's update history: the id of every sample the model was trained on."""
        path = self.checkpoints / "rank0.pt"
        if not path.exists():
            return []
        return list(torch.load(path, map_location="cpu", weights_only=True)["extra"]["trained"])


@dataclass(frozen=True)
class Fault:
    """One kind of kill."""

    worker: str
    """The fleet's name of the process killed."""
    trigger: Callable[[ChaosRun], Awaitable[str]]
    """Returns at the moment to kill, with a note on what the victim is doing."""
    output: str
    """The monitored kind of message the replacement's first work is."""


FAULTS: dict[str, Fault] = {
    "producer mid-publish": Fault("producer-0", ChaosRun.mid_publish, "prompts"),
    "rollout mid-generation": Fault("rollout-0", ChaosRun.mid_generation, "trajectories"),
    "reward mid-scoring": Fault("reward-0", ChaosRun.mid_scoring, "rewards"),
    "buffer mid-batch": Fault("buffer-0", ChaosRun.mid_batch, "batches"),
    "trainer mid-step": Fault("trainer-0", ChaosRun.mid_step, "metrics"),
    "trainer mid-checkpoint": Fault("trainer-0", ChaosRun.mid_checkpoint, "metrics"),
}


def spread(values: list[float]) -> dict[str, float | int | None]:
    """Median and max (seconds, 1 decimal) and how many, of the figures that exist."""
    if not values:
        return {"median": None, "max": None, "n": 0}
    return {"median": round(statistics.median(values), 1), "max": round(max(values), 1), "n": len(values)}


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_run(outcome: Outcome) -> None:
    """A run's kills as a table, then its accounts in one line."""
    state = "finished" if outcome.finished else f"UNFINISHED {outcome.error}"
    print(f"\nrun {outcome.run}: {state} in {outcome.seconds:.0f} s, {outcome.steps_per_s:.2f} steps/s")
    if outcome.kills:
        print(f"  {'fault':<24} {'step':>4}  {'restart s':>9}  {'recovery s':>10}  what it was doing")
    for kill in outcome.kills:
        print(f"  {kill.fault:<24} {kill.step:>4}  {seconds(kill.restart_s):>9}  {seconds(kill.recovery_s):>10}  {kill.note}")
    a = outcome.accounts
    print(f"  issued {a['issued']}  trained {a['trained']}  dropped {a['dropped']} {a['drop_reasons']}  held {a['held']}  "
          f"LOST {a['lost']}  DUPLICATES {a['duplicates']} (stream {a['stream_duplicates']}, checkpoint history "
          f"{a['history_duplicates']} of {a['history_samples']})  STALENESS VIOLATIONS {a['staleness_violations']}",
          flush=True)


def summarize(outcomes: list[Outcome], baselines: list[Outcome], args: argparse.Namespace) -> dict[str, Any]:
    """The invocation's figures: totals over the runs with kills, spreads per fault, ratio."""
    kills = [k for o in outcomes for k in o.kills]
    totals = {key: sum(o.accounts[key] for o in outcomes)
              for key in ("issued", "trained", "dropped", "held", "lost", "duplicates", "staleness_violations")}
    steps_per_s = statistics.mean(o.steps_per_s for o in outcomes)
    return {
        "quick": args.quick, "runs": len(outcomes), "seed": args.seed, "steps": outcomes[0].accounts["steps"],
        "kills": len(kills), "unfinished": sum(not o.finished for o in outcomes), **totals,
        "recovery_s": {f: spread([k.recovery_s for k in kills if k.fault == f and k.recovery_s is not None]) for f in FAULTS},
        "restart_s": {f: spread([k.restart_s for k in kills if k.fault == f and k.restart_s is not None]) for f in FAULTS},
        "steps_per_s": round(steps_per_s, 3),
        "baseline_steps_per_s": round(statistics.mean(b.steps_per_s for b in baselines), 3) if baselines else None,
        "ratio": round(statistics.median(o.steps_per_s / b.steps_per_s for o, b in zip(outcomes, baselines)), 3)
        if baselines else None,
    }


async def chaos(args: argparse.Namespace) -> dict[str, Any]:
    """`--runs` runs with kills, each after an uninterrupted one (unless --quick), on one server."""
    profile = QUICK if args.quick else FULL
    rng = random.Random(args.seed)
    outcomes: list[Outcome] = []
    baselines: list[Outcome] = []
    with EmbeddedNats(args.out / "nats") as server:
        nc = await connect(server.url, "ops-chaos")

        async def run(name: str, kill: bool) -> Outcome:
            outcome = await ChaosRun(server.url, nc, args.out / f"run-{name}", f"chaos-{args.seed}-{name}",
                                     profile, rng).execute(kill)
            print_run(outcome)
            return outcome

        try:
            for i in range(args.runs):
                if profile.baseline:
                    baselines.append(await run(f"{i}-baseline", kill=False))
                outcomes.append(await run(f"{i}", kill=True))
        finally:
            await nc.close()
    return summarize(outcomes, baselines, args)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ops.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.steps} steps a run, no uninterrupted run (ratio null); default {FULL.steps} steps")
    parser.add_argument("--runs", type=int, default=1, help="runs with kills (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill order, gaps and delays (default 0)")
    parser.add_argument("--out", type=Path, help="directory of the runs and their logs (default runs/chaos-<time>)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    args.out = args.out or Path("runs") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s chaos %(levelname)s %(message)s")
    print(f"chaos: runs and logs in {args.out}", flush=True)
    summary = asyncio.run(chaos(args))
    print(json.dumps(summary))
    broken = summary["unfinished"] + summary["lost"] + summary["duplicates"] + summary["staleness_violations"]
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
