"""Elastic rollout: workers join and leave a running run; throughput follows, nothing is lost.

A real producer and a one-worker-per-role fleet run on a server of their own, with a
config where generation is the bottleneck (deep thin model, two samples a prompt, one
prompt per generate call, a staleness bound loose enough to keep prompts queued). Mid-run a second
fleet adds two rollout workers, as a new node would, with nothing else restarted; then it is stopped
with SIGTERM (its workers drain) and the run finishes on the first. Trajectories stored
per second are measured with one worker, with three, and with one again (the mean of the
two single-worker figures is the baseline, so that a machine that slows or speeds up
during the test does not pass for an effect of the workers); the streams are audited.

The figures are printed (`pytest -s`), with the most prompts the rollout queue had in
flight, which must stay within what the workers may hold (a worker that takes more hoards
the queued prompts a newcomer needs). Measured on the 2-core dev machine (shared, load 2-3):
20.6-22.5 trajectories/s with one worker, 31.5-35.0 with three (x1.52-1.62), ~80 s in all.
Other heavy jobs on the same cores shrink the rise: the new workers need idle CPU.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from nats.js.errors import NotFoundError

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.topology import PROMPTS, TRAJECTORIES, Topology
from consumers.fleet_config import FleetConfig, RoleConfig, local_fleet
from consumers.supervisor import Supervisor
from ops.audit import audit
from schemas.config import AlgorithmConfig, RunConfig
from tests.helpers import members, wait_for

ROOT = Path(__file__).resolve().parent.parent
RUN = "elastic"
STEPS = 44
PROMPTS_PER_STEP = 16
SAMPLES = 2
MAX_STALENESS = 4
MAX_BATCH_PROMPTS = 1
HELD_PER_WORKER = 2 * 2 * MAX_BATCH_PROMPTS
"""Prompts the queue may count in flight per rollout worker: its Worker's concurrency
(consumers/rollout.py), doubled because the server may take a worker's next pull request
before the acks sent ahead of it, so a prompt just acked can count a moment longer."""
WINDOW = 160
"""Trajectories over which each throughput figure is measured: a count, not a time, so that
the run outlasts every measurement on a machine of any speed."""
MIN_GAIN = 1.15
"""Least rise of throughput with three rollout workers: the machine may have only two cores."""


def elastic_config(tmp_path: Path) -> Path:
    config = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    config["run"] = RUN
    config["data"]["n"] = SAMPLES
    config["data"]["sampling"]["max_tokens"] = 32
    # Rewards that differ within a group (lengths): few groups are dropped, so the run's length
    # in trajectories is about known.
    config["data"]["reward"] = "tests.reward_fns:length"
    # Generation must dominate the run's CPU, or a 2-core machine has none to give new workers:
    # many thin layers and two samples a prompt make a decode step (every layer, per token)
    # serve few trajectories (~40 ms of CPU each, the rest of the pipeline ~8), while the
    # trainer's one pass per batch stays cheap. Weights every other step: every worker loads
    # each version. A learning rate too small to change the policy keeps the work per
    # trajectory the same from start to end.
    config["model"].update(hidden=32, layers=24)
    config["algorithm"].update(
        prompts_per_step=PROMPTS_PER_STEP, max_staleness=MAX_STALENESS, lr=1e-6
    )
    config["trainer"].update(steps=STEPS, checkpoint_every=STEPS, sync_every=2)
    # One prompt per generate call and a worker holds two: queued prompts are left for newcomers
    # (up to (max_staleness + 1) x prompts_per_step are admitted at once).
    config["rollout"] = {"max_batch_prompts": MAX_BATCH_PROMPTS}
    path = tmp_path / "elastic.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass(frozen=True)
class Progress:
    stored: int
    """Trajectories stored so far."""
    queued: int
    """Prompts waiting for a rollout worker."""
    in_flight: int
    """Prompts delivered to rollout workers and not yet acked."""


def progress(url: str, topology: Topology) -> Progress:
    """Where the run stands (all 0 before its streams are declared)."""

    async def read() -> Progress:
        nc = await connect(url, "elastic-progress")
        js = nc.jetstream()
        try:
            stored = (await js.stream_info(topology.stream(TRAJECTORIES))).state.last_seq
            rollout = await js.consumer_info(topology.stream(PROMPTS), PROMPTS.work_queue.durable)
            return Progress(stored, rollout.num_pending, rollout.num_ack_pending)
        except NotFoundError:
            return Progress(0, 0, 0)
        finally:
            await nc.close()

    return asyncio.run(read())


@dataclass(frozen=True)
class Window:
    rate: float
    """Trajectories stored per second."""
    most_in_flight: int
    """The most prompts the rollout workers held at once."""
    least_queued: int
    """The fewest prompts waiting: above 0, generation was the bottleneck throughout."""


def measure(
    url: str, topology: Topology, fleets: list[Supervisor], producer: subprocess.Popen[str]
) -> Window:
    """Throughput while WINDOW more trajectories are stored, the fleets supervised meanwhile."""
    first, started = progress(url, topology), time.monotonic()
    now, most_in_flight, least_queued = first, 0, first.queued
    while now.stored - first.stored < WINDOW:
        assert producer.poll() is None, "the run ended before the measurement did: raise STEPS"
        for fleet in fleets:
            fleet.check()
        time.sleep(0.25)
        now = progress(url, topology)
        most_in_flight, least_queued = (
            max(most_in_flight, now.in_flight),
            min(least_queued, now.queued),
        )
    return Window(
        (now.stored - first.stored) / (time.monotonic() - started), most_in_flight, least_queued
    )


def serving_rollouts(url: str, topology: Topology) -> int:
    """Rollout workers that have loaded their model and joined."""
    return sum(1 for m in members(url, topology) if m.role == "rollout" and m.engine)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_rollout_workers_join_and_leave_a_running_run(
    own_nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    url, topology = own_nats_server.url, Topology(run=RUN)
    producer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--config",
            str(elastic_config(tmp_path)),
            "--nats",
            url,
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    base = Supervisor(local_fleet(tmp_path / "logs"), RUN, url)
    extra = Supervisor(
        FleetConfig(roles={"rollout": RoleConfig(processes=2)}, logs=tmp_path / "extra-logs"),
        RUN,
        url,
    )
    base.start()
    try:
        # Warm: the model is built, every worker serves, trajectories flow.
        # check() returns None or raises: `or` runs it before each look.
        wait_for(lambda: base.check() or progress(url, topology).stored >= 2 * SAMPLES, 120)  # type: ignore[func-returns-value]
        before = measure(url, topology, [base], producer)

        extra.start()  # a new node's fleet: nothing else restarts
        joining = time.monotonic()
        wait_for(lambda: base.check() or extra.check() or serving_rollouts(url, topology) == 3, 120)  # type: ignore[func-returns-value]
        joined = time.monotonic() - joining
        measure(
            url, topology, [base, extra], producer
        )  # settling: a new worker's first calls are slow
        after = measure(url, topology, [base, extra], producer)

        extra.stop()  # SIGTERM: they finish their prompts and leave
        assert [c.proc.returncode for c in extra.children.values() if c.proc] == [0, 0]
        wait_for(lambda: serving_rollouts(url, topology) == 1, 5)
        again = measure(url, topology, [base], producer)
        baseline = (before.rate + again.rate) / 2
        print(
            f"\nrollout throughput, trajectories/s: {before.rate:.1f} with 1 worker, "
            f"{after.rate:.1f} with 3, {again.rate:.1f} with 1 again "
            f"(x{after.rate / baseline:.2f}); joining took {joined:.0f}s; "
            "prompts in flight at most "
            f"{before.most_in_flight}/{after.most_in_flight}/{again.most_in_flight}, "
            "queued at least "
            f"{before.least_queued}/{after.least_queued}/{again.least_queued}"
        )

        out, _ = producer.communicate(timeout=240)
        assert producer.returncode == 0, out
        base.check()
    finally:
        base.stop()
        extra.stop()
        if producer.poll() is None:
            producer.kill()
    assert max(before.most_in_flight, again.most_in_flight) <= HELD_PER_WORKER
    assert after.most_in_flight <= 3 * HELD_PER_WORKER
    assert after.rate >= MIN_GAIN * baseline, (
        f"three rollout workers stored {after.rate:.1f} trajectories/s, one {baseline:.1f}: "
        f"less than x{MIN_GAIN} (were other jobs using these cores? the new workers need idle CPU)"
    )
    assert base.children["trainer-0"].state == "done"
    assert json.loads(out.strip().splitlines()[-1])["steps"] == STEPS

    async def audited() -> dict:
        nc = await connect(url, "elastic-audit")
        try:
            staleness = RunConfig(algorithm=AlgorithmConfig(max_staleness=MAX_STALENESS)).staleness
            return await audit(nc.jetstream(), topology, staleness)
        finally:
            await nc.close()

    result = asyncio.run(audited())
    assert (
        result["duplicates"] == 0
        and result["trained_and_dropped"] == 0
        and result["staleness_violations"] == 0
    )
    assert result["issued"] == result["trained"] + result["dropped"] + result["in_flight"]
    assert (
        result["steps"] == STEPS and result["samples_trained"] == STEPS * PROMPTS_PER_STEP * SAMPLES
    )
