"""One stage shape (`bus.stage`): worker processes run by `run_stage`, as a fleet runs them.

- A helper that raises takes its process down: the rollout's weights watcher fails while it
  loads a version (the gate closed, so no prompt would ever be generated again), and the
  process exits 1 with a line naming the helper and the error, for the fleet to restart it.
  As a bare task, it died alone and the process stayed up, holding and heartbeating its
  prompts and doing nothing.
- SIGTERM still drains: the reward stage, its handlers mid-scoring, stops fetching, finishes
  and acks what it holds, then exits 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from nats.js.errors import BucketNotFoundError
from transformers import AutoModelForCausalLM

from bus.connection import connect
from bus.crashpoints import (
    CRASH_AT,
    CRASH_RECORD,
    FAIL_AT,
    ROLLOUT_MID_WEIGHT_LOAD,
)
from bus.embedded import EmbeddedNats
from bus.lag import queue_lag
from bus.membership import Membership
from bus.publisher import Publisher
from bus.runtime import attach, publish_config
from bus.stage import LOSS_GUARD, MEMBERSHIP, Stage, serve
from bus.tasks import cancel_until_done
from bus.topology import REWARDS, TRAJECTORIES, WEIGHTS, Topology
from bus.worker import WorkerOptions
from engines.tiny import build_tiny_model
from producers.tasks import VOCAB
from schemas import RewardEvent, Rewards, decode
from schemas.config import RunConfig
from tests.helpers import messages, store_weights, trajectory

ROOT = Path(__file__).resolve().parent.parent
EXIT_SECONDS = 60.0
"""How long a failed stage may take to exit, start-up (torch, the model) included."""
SCORE_SECONDS = 2.0
"""How long each reward takes: long enough that SIGTERM finds them in flight."""
STOPS = 8
"""Stops of a stage whose helpers request back to back. Before the fix 16 of 30 such stops hung
(measured), so 8 in a row pass by chance about 1 time in 400."""
REQUESTERS = 3
"""Helpers beside the loss guard that make one NATS request after another."""
STOP_SECONDS = 5.0
"""How long a stopped stage (fetch timeout 0.1 s, nothing in hand) may take to end."""


def worker(role: str, topology: Topology, url: str, **env: str) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if k not in (CRASH_AT, CRASH_RECORD, FAIL_AT)}
    return subprocess.Popen(
        [sys.executable, "-m", f"consumers.{role}", "--run", topology.run, "--nats", url],
        cwd=ROOT,
        env={**clean, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def exited(proc: subprocess.Popen[str], seconds: float, what: str) -> tuple[int, str]:
    """The process's exit status and stderr; fails the test if it is still running after
    `seconds`."""
    try:
        _, stderr = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"{what}: still running {seconds:.0f} s on; its log:\n{stderr[-3000:]}")
    return proc.returncode, stderr


def test_a_helper_that_raises_takes_its_worker_down(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    model_dir = build_tiny_model(tmp_path / "model", VOCAB)

    async def declare() -> None:
        nc = await connect(nats_server.url, "test-stage")
        js = nc.jetstream()
        await topology.apply(js)
        config = RunConfig.model_validate({"run": topology.run, "model": {"path": str(model_dir)}})
        await publish_config(await js.key_value(topology.kv_bucket), config)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        event = await store_weights(js, topology, 1, params)
        await Publisher(js, topology).publish(WEIGHTS, event)
        await nc.close()

    asyncio.run(declare())
    # The watcher fails where a load is under way: the gate closed, the bytes fetched.
    proc = worker(
        "rollout", topology, nats_server.url, **{FAIL_AT: f"{ROLLOUT_MID_WEIGHT_LOAD.name}@1"}
    )
    status, stderr = exited(proc, EXIT_SECONDS, "the rollout worker whose weights watcher failed")
    assert status == 1, (
        f"exit status {status}, expected 1 (a failure the fleet restarts):\n{stderr[-3000:]}"
    )
    last = stderr.strip().splitlines()[-1]
    assert last == (
        "consumers.rollout: helper weights watcher failed: InjectedFailure: "
        f"{FAIL_AT} {ROLLOUT_MID_WEIGHT_LOAD.name} (pass 1): v1"
    ), stderr[-3000:]
    assert "ERROR helper weights watcher failed: InjectedFailure" in stderr, (
        "no log line names the helper"
    )


def test_sigterm_drains_a_stage_and_exits_zero(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    config = RunConfig.model_validate(
        {
            "run": topology.run,
            "data": {"reward": "tests.reward_fns:reverse_or_misbehave"},
            "reward": {"processes": 2, "timeout": 30.0},
        }
    )
    count = 4
    slow = [
        trajectory(topology.run, prompt=i).model_copy(
            update={"task": {"misbehave": "slow", "seconds": SCORE_SECONDS}}
        )
        for i in range(count)
    ]

    async def declare() -> None:
        nc = await connect(nats_server.url, "test-stage")
        js = nc.jetstream()
        await topology.apply(js)
        await publish_config(await js.key_value(topology.kv_bucket), config)
        publisher = Publisher(js, topology)
        for event in slow:
            await publisher.publish(TRAJECTORIES, event)
        await nc.close()

    async def in_flight() -> int:
        nc = await connect(nats_server.url, "test-stage")
        try:
            lag = (await queue_lag(nc.jetstream(), topology))[TRAJECTORIES.work_queue.durable]
            return 0 if lag is None else lag.in_flight
        finally:
            await nc.close()

    asyncio.run(declare())
    proc = worker("reward", topology, nats_server.url)
    deadline = time.monotonic() + EXIT_SECONDS
    while (held := asyncio.run(in_flight())) < count:
        assert proc.poll() is None, (
            f"the reward worker exited before taking its work:\n{proc.communicate()[1]}"
        )
        assert time.monotonic() < deadline, f"the reward worker took {held} of {count} trajectories"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    status, stderr = exited(proc, 4 * count * SCORE_SECONDS + 30, "the reward worker after SIGTERM")
    assert status == 0, f"exit status {status} after SIGTERM:\n{stderr[-3000:]}"

    async def outcome() -> tuple[int, set[str]]:
        nc = await connect(nats_server.url, "test-stage")
        js = nc.jetstream()
        lag = (await queue_lag(js, topology))[TRAJECTORIES.work_queue.durable]
        sub = await js.subscribe(topology.subject(REWARDS), ordered_consumer=True)
        stored = {
            decode((await sub.next_msg(timeout=5)).data, RewardEvent).id
            for _ in range(await messages(js, topology, REWARDS))
        }
        await nc.close()
        assert lag is not None
        return lag.in_flight, stored

    left, stored = asyncio.run(outcome())
    assert stored == {t.id for t in slow}, f"scored before exiting: {sorted(stored)} of {count}"
    assert left == 0, (
        f"{left} trajectories left unacked: the worker exited without settling what it held"
    )


def test_a_membership_heartbeat_stops_when_cancelled_just_after_a_report(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """A stage cancels its helpers when it stops; a rollout reports its weight version at any
    moment. The heartbeat once waited with `asyncio.wait_for`, which on Python 3.11 swallows a
    cancel that lands as the event it waits on is set: the beat went on, the stage's TaskGroup
    waited for it forever, and the fleet SIGKILLed the worker 30 s after SIGTERM."""

    async def run() -> list[int]:
        nc = await connect(nats_server.url, "test-stage")
        js = nc.jetstream()
        await topology.apply(js)
        member = await Membership.join(js, topology, "rollout", background=False)
        still_running = []
        try:
            for attempt in range(24):
                beat = asyncio.create_task(member.beat())
                await asyncio.sleep(0.01)
                member.report(weight_version=attempt)
                for _ in range(
                    attempt % 4
                ):  # the cancel lands 0-3 turns of the loop after the report
                    await asyncio.sleep(0)
                beat.cancel()
                done, _ = await asyncio.wait([beat], timeout=2.0)
                if not done:
                    still_running.append(attempt)
                    beat.cancel()
                    await asyncio.wait([beat], timeout=2.0)
        finally:
            await member.leave()
            await nc.close()
        return still_running

    still_running = asyncio.run(run())
    assert not still_running, (
        f"the heartbeat went on after being cancelled, in attempts {still_running}"
    )


def test_a_stage_stops_while_its_helpers_are_mid_request(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """SIGTERM (here: the stop event) ends a stage whatever its helpers are awaiting. Its loss
    guard and heartbeat make NATS requests, and nats-py awaits each reply in `asyncio.wait_for`,
    which on Python 3.11 swallows a cancel when the reply is in by the time the helper resumes:
    cancelled once, the helper looped on, the stage's TaskGroup waited for it forever, and the
    fleet SIGKILLed the worker 30 s after SIGTERM. Here the loss guard checks back to back, and
    helpers beside it request without a pause, so every stop finds them mid-request."""
    config = RunConfig.model_validate({"run": topology.run, "streams": {"guard_seconds": 0.001}})

    async def stop_repeatedly() -> list[int]:
        nc = await connect(nats_server.url, "test-stage")
        js = nc.jetstream()
        await topology.apply(js)
        await publish_config(await js.key_value(topology.kv_bucket), config)
        await nc.close()
        rt = await attach("buffer", topology.run, nats_server.url, beat_in_background=False)

        async def idle(_event: Rewards, _msg: object) -> None:
            return None

        async def requests() -> None:  # as the guard and the heartbeat do, back to back
            while True:
                await rt.js.stream_info(rt.topology.stream(REWARDS))

        hung = []
        try:
            for attempt in range(STOPS):
                stop = asyncio.Event()
                helpers = {f"requests {i}": requests for i in range(REQUESTERS)}
                stage = Stage(REWARDS, idle, WorkerOptions(fetch_timeout=0.1), helpers=helpers)
                served = asyncio.create_task(serve(rt, stage, stop))
                await asyncio.sleep(0.05 + 0.01 * attempt)  # the helpers are mid-request
                stop.set()
                done, _ = await asyncio.wait([served], timeout=STOP_SECONDS)
                if (
                    not done
                ):  # clean up: cancel the helpers as the fixed stage does, so the stage ends
                    hung.append(attempt)
                    names = {*helpers, LOSS_GUARD, MEMBERSHIP}
                    await cancel_until_done(
                        [task for task in asyncio.all_tasks() if task.get_name() in names]
                    )
                    await served
                    break
                served.result()
        finally:
            await rt.close()
        return hung

    hung = asyncio.run(stop_repeatedly())
    assert not hung, (
        f"the stage was still running {STOP_SECONDS:.0f} s after its stop, in attempt {hung[0]}"
    )


def test_sigterm_while_a_worker_waits_to_join_its_run_ends_it_cleanly(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """A worker joins its run before it builds its stage, and joining waits (up to minutes) for
    the run's config. SIGTERM then, as a fleet sends it to a worker it stops at any moment, must
    end it at once with exit 0, not kill it by the signal's default action mid-join."""

    async def bucket_declared() -> bool:
        nc = await connect(nats_server.url, "test-stage")
        try:
            await nc.jetstream().key_value(topology.kv_bucket)
            return True
        except BucketNotFoundError:
            return False
        finally:
            await nc.close()

    proc = worker("buffer", topology, nats_server.url)  # no config in KV: it waits for one
    deadline = time.monotonic() + EXIT_SECONDS
    while not asyncio.run(bucket_declared()):
        assert proc.poll() is None, (
            f"the worker exited before waiting for its config:\n{proc.communicate()[1]}"
        )
        assert time.monotonic() < deadline, "the worker never declared its run's buckets"
        time.sleep(0.1)
    time.sleep(1.0)  # into the wait for the config
    assert proc.poll() is None, (
        f"the worker stopped waiting for its config:\n{proc.communicate()[1]}"
    )
    proc.send_signal(signal.SIGTERM)
    status, stderr = exited(proc, 10, "the worker after SIGTERM while waiting to join")
    assert status == 0, f"exit status {status} after SIGTERM while joining:\n{stderr[-3000:]}"
    assert "stopped before it joined the run" in stderr, stderr[-3000:]
