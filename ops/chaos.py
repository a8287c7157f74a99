"""`python -m ops.chaos [--quick] [--runs N] [--seed S] [--out DIR]`:
SIGKILL every kind of process at named crash points, then audit.

Each run is the built-in job (`examples/digits.yaml`, shortened) against an embedded
nats-server this tool owns, every process of it — the producer too, with `--nats URL --out
DIR` — supervised by `consumers.supervisor.Supervisor`, which restarts what dies. Every fault is
a crash point of `bus.crashpoints` (its `moment` says what has happened and what has
not): the process kills itself with SIGKILL at that very moment, not at one guessed from
outside. A full run fires all ten; --quick six (one per role, the trainer's twice):
producer.mid_publish, rollout.mid_generation, reward.mid_scoring, buffer.mid_step (one
micro-batch of a step stored, the others not), trainer.mid_step, trainer.mid_checkpoint (a
checkpoint written beside the last, not yet in its place).

Arming (`ops.faults`): each point gets a target step, spread over the run in a seeded
random order one slot each, and is armed through its role's `env` as
`JETRL_CRASH_AT=<point>@k`, k the pass estimated to come at the target;
`JETRL_CRASH_RECORD=<run dir>/crashes` makes it fire once, and the file it leaves there
(point, pid, time, what it was working on) is how this tool learns of the kill. A role
with several points is armed with the next one in its replacement, counted from then.
Kills are spread by steps, and a kill's stall holds the steps back, so a recovery is
mostly over before the next kill comes; each kill is measured on its own in any case.

Per kill, the table shows the step it hit at (the trainer's last written one), what the
process was doing (the record's note, what its queue held unacked, and for the buffer and
checkpoint points what the bus and the disk show: how many of the step's micro-batches
were sent; the new checkpoint beside the old), and:

    restart     kill -> the replacement process joined the run (its membership entry)
    recovery    kill -> the replacement's first output: a prompt, trajectory, reward or batch
                event whose `source` is its worker id; for the trainer, a step beyond the last
                one before the kill (so after retraining the steps since its checkpoint). The
                work the victim held comes back after ack_wait, and a step waiting for it
                stalls the run (a rollout's replacement gets no new prompt until then).

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

The run is declared as users get it: the work queues' `ack_wait` is the default
(`bus.topology.ACK_WAIT`, 10 s, kept alive by the workers' heartbeats), so a killed worker's
messages come back within it. `resume` is the figure the defaults are held to: from the
replacement joining the run to the next step trained (target 15 s); a table per role ends
each invocation.

Prints a table per run, then as its last line one JSON object: totals of the figures above,
`faults`: per point, whether it was hit in every run it was armed in, the steps it hit at,
and its `restart_s` and `recovery_s` (median, max); and `ratio`: the median over the runs of
steps/s with kills / steps/s of an uninterrupted run of the same config just before it (both
from first to last step, so start-up is left out; pairs, because other work on the machine
changes the pace over minutes). --quick skips the uninterrupted runs: `ratio` null.
Exits 1 if a run did not finish, a fault armed was not hit, or anything was lost,
duplicated or over-staled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from nats.aio.client import Client

from bus import crashpoints
from bus.connection import JetStream, connect
from bus.crashpoints import (
    BUFFER_MID_STEP,
    BUFFER_STEP_STORED,
    PRODUCER_MID_PUBLISH,
    REWARD_MID_SCORING,
    ROLLOUT_MID_GENERATION,
    TRAINER_MID_CHECKPOINT,
    TRAINER_MID_STEP,
    CrashPoint,
)
from bus.embedded import EmbeddedNats
from bus.lag import queue_info, queue_lag
from bus.membership import live_members
from bus.pull import Puller
from bus.tasks import cancel_until_done
from bus.topology import (
    ACK_WAIT,
    PROMPTS,
    Topology,
    metrics_key,
)
from consumers.fleet_config import ROLES, FleetConfig, RoleConfig
from consumers.supervisor import POLL_SECONDS, Supervisor
from consumers.update_history import UpdateHistory
from ops.audit import audit
from ops.chaos_monitor import Monitor, first_output
from ops.faults import (
    ALL,
    OUTPUT,
    Kill,
    Outcome,
    Shape,
    arm_at,
    plan,
    print_roles,
    print_run,
    summarize,
)
from producers.prompts import BUILTIN
from schemas.config import load_config
from schemas.kv_records import StepMetrics

MICRO_BATCH_TOKENS = 256
"""Small enough that a step is several micro-batches, so buffer.mid_step lands between them."""
FIRST_TARGET = 3
"""No kill before this step: the run's first steps include every worker's start-up."""


@dataclass(frozen=True)
class Profile:
    """How long a run is and which points it fires."""

    steps: int
    checkpoint_every: int
    faults: tuple[CrashPoint, ...]
    tail: int
    """No target in the last `tail` steps: room for the last kill's recovery, and for a
    point that fires a little after its target."""
    timeout: float
    """Seconds a run may take before it is stopped and counted as unfinished."""
    baseline: bool
    """Run each run once without kills first, for `ratio`."""


QUICK = Profile(
    steps=40,
    checkpoint_every=4,
    tail=8,
    timeout=180.0,
    baseline=False,
    faults=(
        PRODUCER_MID_PUBLISH,
        ROLLOUT_MID_GENERATION,
        REWARD_MID_SCORING,
        BUFFER_MID_STEP,
        TRAINER_MID_STEP,
        TRAINER_MID_CHECKPOINT,
    ),
)
FULL = Profile(steps=100, checkpoint_every=5, faults=ALL, tail=10, timeout=1200.0, baseline=True)


class ChaosRun:
    """One run: its fleet (producer included), the crash points armed in it, and its accounts."""

    def __init__(
        self, url: str, nc: Client, out: Path, run: str, profile: Profile, rng: random.Random
    ) -> None:
        self.url, self.nc, self.js, self.out, self.profile, self.rng = (
            url,
            nc,
            nc.jetstream(),
            out,
            profile,
            rng,
        )
        self.topology = Topology(run=run)
        self.monitor = Monitor(nc, self.topology)
        self.checkpoints = (out / "checkpoints").resolve()
        self.crashes = (out / "crashes").resolve()
        self.shape = Shape.of(load_config(self.write_config()))
        self.kills: list[Kill] = []
        self.measuring: list[asyncio.Task[None]] = []
        self.fleet: Supervisor | None = None

    def write_config(self) -> Path:
        """The built-in config, shortened, checkpointing often, with small micro-batches."""
        config = load_config(BUILTIN).model_dump(mode="json")
        config["run"] = self.topology.run
        config["trainer"].update(
            steps=self.profile.steps,
            checkpoint_every=self.profile.checkpoint_every,
            micro_batch_tokens=MICRO_BATCH_TOKENS,
            checkpoint_dir=str(self.checkpoints),
        )
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    async def declare(self) -> None:
        """Declare the run before any of its processes does, with the limits its config derives."""
        await Topology.for_config(load_config(self.out / "config.yaml")).apply(self.js)

    def supervisor(self) -> Supervisor:
        """The run's fleet, each role's first process armed with its first point."""
        producer = ["--config", str(self.out / "config.yaml"), "--out", str(self.out)]
        roles = {
            "producer": RoleConfig(module="producers.prompts", args=producer),
            **{r: RoleConfig() for r in ROLES if r != "reference"},
        }
        roles = {
            name: role.model_copy(update={"env": self.arm(name, None)})
            for name, role in roles.items()
        }
        return Supervisor(
            FleetConfig(roles=roles, logs=self.out / "logs"), self.topology.run, self.url
        )

    def arm(self, role: str, since: int | None) -> dict[str, str]:
        """The environment of `role`'s next process: its next point not yet armed (if any) at
        the pass estimated to come at its target, counted from step `since`."""
        env = {crashpoints.CRASH_RECORD: str(self.crashes)}
        kill = next((k for k in self.kills if k.point.role == role and k.k is None), None)
        if kill is not None:
            kill.k, kill.since = arm_at(self.shape, kill.point, kill.target, since, self.rng), since
            env[crashpoints.CRASH_AT] = crashpoints.arm(f"{kill.point.name}@{kill.k}")
        return env

    async def execute(self, kill: bool) -> Outcome:
        """Run to the end (or the timeout) with the profile's points armed if `kill`;
        stop the fleet; account."""
        await self.declare()
        await self.monitor.start()
        if kill:
            last = self.profile.steps - self.profile.tail
            self.kills = [
                Kill(point, target)
                for point, target in plan(self.profile.faults, FIRST_TARGET, last, self.rng)
            ]
        self.fleet = self.supervisor()
        started = time.time()
        self.fleet.start()
        error = ""
        try:
            finished = await self.supervise(time.monotonic() + self.profile.timeout)
        except RuntimeError as exc:  # a worker given up on: the reason's first line says which
            finished, error = False, str(exc).splitlines()[0]
        finally:
            await cancel_until_done(self.measuring)  # one mid-request can swallow one cancel
            for result in await asyncio.gather(*self.measuring, return_exceptions=True):
                if isinstance(result, Exception):
                    raise result  # a measurement's own failure
            self.fleet.stop()
            await self.monitor.stop()
        self.observe(live=False)  # a point that fired as the run ended is still a hit
        seconds = time.time() - started
        return Outcome(
            self.topology.run,
            finished,
            error,
            self.monitor.steps_per_s(),
            seconds,
            await self.account(),
            self.kills,
        )

    async def supervise(self, deadline: float) -> bool:
        """Keep the fleet up until the producer and the trainer are done
        (True) or the deadline (False)."""
        assert self.fleet is not None
        while time.monotonic() < deadline:
            # Before the fleet's poll: a point's record is written before its process dies, so
            # the replacement, started by a later poll, is always started armed with the next.
            self.observe()
            self.fleet.check()
            if all(
                self.fleet.children[name].state == "done" for name in ("producer-0", "trainer-0")
            ):
                return True
            await asyncio.sleep(POLL_SECONDS)
        return False

    def observe(self, live: bool = True) -> None:
        """Take note of the points that fired since the last look; while the fleet is `live`,
        arm the victim's replacement with its role's next point and measure its recovery."""
        for name, record in crashpoints.records(self.crashes).items():
            kill = next((k for k in self.kills if k.point.name == name), None)
            if kill is None or kill.hit:
                continue
            at, pid = record.get("time"), record.get("pid")
            # A record left empty (killed while writing it): the time its file was made.
            kill.at = (
                float(at) if isinstance(at, (int, float)) else (self.crashes / name).stat().st_mtime
            )
            kill.pid = pid if isinstance(pid, int) else None
            kill.note, kill.step = str(record.get("note", "")), self.monitor.last_step
            if live and self.fleet is not None:
                self.fleet.children[kill.worker].env = self.arm(
                    kill.point.role, self.monitor.last_step
                )
                self.measuring.append(asyncio.create_task(self.measure(kill)))

    async def measure(self, kill: Kill) -> None:
        """What the victim was doing; when its replacement joined the run and did its first work."""
        assert kill.at is not None
        # What the server sent us before this round trip includes what the victim had stored
        # before it died (it wrote its record after): its last metrics, its micro-batches.
        await self.nc.flush()
        kill.step = self.monitor.last_step
        kind = OUTPUT[kill.point.role]
        output = self.monitor.next(kind, first_output(kind, kill.pid, kill.step))
        notes = [kill.note, self.evidence(kill.point)]
        if (
            self.topology.served_by(kill.point.role) is not None
        ):  # what it held stays unacked until ack_wait: look now
            notes.append(await self.holding(kill.point.role))
        kill.note = ", ".join(filter(None, notes))
        joined = await self.rejoined(kill.worker, kill.pid)
        kill.restart_s = joined - kill.at
        await output
        kill.recovery_s = time.time() - kill.at
        while not any(t >= joined for t in self.monitor.trained_at):
            await self.monitor.next("metrics")
        kill.resume_s = min(t for t in self.monitor.trained_at if t >= joined) - joined

    def evidence(self, point: CrashPoint) -> str:
        """What the bus or the disk shows of the moment, for the points where it shows."""
        if point in (BUFFER_MID_STEP, BUFFER_STEP_STORED) and self.monitor.micro:
            step = max(self.monitor.micro)
            return (
                f"{len(self.monitor.micro[step])} of {self.monitor.micro_count[step]} "
                "micro-batches sent"
            )
        if point is TRAINER_MID_CHECKPOINT:
            # engines.torch_train writes the new checkpoint to this sibling, then renames it
            # over rank0.pt; a trainer that died in between leaves it.
            written = (self.checkpoints / ".rank0.pt.tmp").exists()
            return "new checkpoint beside the last" if written else "NO new checkpoint file"
        return ""

    async def rejoined(self, worker: str, killed: int | None) -> float:
        """Unix time the killed worker's replacement joined the run
        (its membership entry's start)."""
        assert self.fleet is not None
        role = worker.rsplit("-", 1)[0]
        while True:
            pid = self.fleet.pid(worker)
            if pid not in (None, killed):
                for member in await live_members(self.js, self.topology):
                    if member.role == role and member.pid == pid:
                        return member.started_at
            await asyncio.sleep(POLL_SECONDS)

    async def holding(self, role: str) -> str:
        lag = (await queue_lag(self.js, self.topology))[role]
        return f"held {'?' if lag is None else lag.in_flight} unacked"

    # Accounts.

    async def account(self) -> dict[str, Any]:
        """The audit of the streams, plus what the module doc defines: held, lost, duplicates."""
        found = await audit(self.js, self.topology, load_config(self.out / "config.yaml").staleness)
        candidates = set(found.pop("in_flight_ids"))
        held = await self.held(candidates) if candidates else set()
        history = await self.trained_history()
        history_duplicates = len(history) - len(set(history))
        return {
            **{
                k: found[k]
                for k in (
                    "issued",
                    "trained",
                    "dropped",
                    "steps",
                    "samples_trained",
                    "staleness_violations",
                )
            },
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
        assert isinstance(self.js, JetStream)
        for channel in self.topology.work_queues:
            info = await queue_info(self.js, self.topology, channel)
            unacked = (info.num_pending or 0) + (info.num_ack_pending or 0)
            sequences: set[int] = set()
            deadline = (
                time.monotonic() + ACK_WAIT + 5
            )  # what a stopped worker held comes back by then
            # The work queue's own pulls (`bus.pull`), as a worker's; what they bring stays
            # unacked.
            puller = Puller(self.js, self.topology.stream(channel), channel.work_queue.durable)
            await puller.open()
            try:
                while len(sequences) < unacked and (left := deadline - time.monotonic()) > 0:
                    with contextlib.suppress(TimeoutError):
                        for msg in await puller.fetch(unacked - len(sequences), left):
                            sequences.add(msg.metadata.sequence.stream)
                            # Event ids: a prompt's, or `<prompt id>/<sample>` for its
                            # trajectories and rewards.
                            event_id = (msg.headers or {}).get("Nats-Msg-Id", "")
                            group = event_id.rsplit("/", 1)[0]
                            found.add(event_id if channel is PROMPTS else group)
            finally:
                await puller.close()
        return found & candidates

    async def trained_history(self) -> list[str]:
        """The final model's update history: the ids of every sample it was trained on, by step.

        The checkpoint keeps it as a hash chain (`consumers.update_history`); the ids come from
        the trainer's per-step metrics records in KV, and must hash to the checkpoint's chain,
        else the records are not the model's history and the run counts as broken.
        """
        path = self.checkpoints / "rank0.pt"
        if not path.exists():
            return []
        kept = UpdateHistory.from_dict(
            torch.load(path, map_location="cpu", weights_only=True)["extra"]["history"]
        )
        kv = await self.js.key_value(self.topology.kv_bucket)
        steps = [
            StepMetrics.decode((await kv.get(metrics_key(0, step))).value).sample_ids
            for step in range(kept.steps)
        ]
        if UpdateHistory.of_steps(steps) != kept:
            raise RuntimeError(
                f"the metrics records of steps 0-{kept.steps - 1} are not the checkpoint's update "
                "history"
            )
        return [sid for step in steps for sid in step]


async def chaos(args: argparse.Namespace) -> dict[str, Any]:
    """`--runs` runs with kills, each after an uninterrupted one (unless --quick), on one server."""
    profile = QUICK if args.quick else FULL
    rng = random.Random(args.seed)
    outcomes: list[Outcome] = []
    baselines: list[Outcome] = []
    with EmbeddedNats(args.out / "nats") as server:
        nc = await connect(server.url, "ops-chaos")

        async def run(name: str, kill: bool) -> Outcome:
            outcome = await ChaosRun(
                server.url, nc, args.out / f"run-{name}", f"chaos-{args.seed}-{name}", profile, rng
            ).execute(kill)
            print_run(outcome)
            return outcome

        try:
            for i in range(args.runs):
                if profile.baseline:
                    baselines.append(await run(f"{i}-baseline", kill=False))
                outcomes.append(await run(f"{i}", kill=True))
        finally:
            await nc.close()
    figures = summarize(outcomes, baselines, args.quick, args.seed)
    print_roles(figures["roles"])
    return figures


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ops.chaos", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK.steps} steps a run, no uninterrupted run (ratio null); "
        f"default {FULL.steps} steps",
    )
    parser.add_argument("--runs", type=int, default=1, help="runs with kills (default 1)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the points' order, target steps and passes (default 0)",
    )
    parser.add_argument(
        "--out", type=Path, help="directory of the runs and their logs (default runs/chaos-<time>)"
    )
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
    broken = (
        summary["unfinished"]
        + len(summary["not_hit"])
        + summary["lost"]
        + summary["duplicates"]
        + summary["staleness_violations"]
    )
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
