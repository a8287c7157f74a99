"""The bus against a real nats-server: dedup, retries, dead letters, crash and drain."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgpack
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import EventTooLarge, Publisher
from bus.topology import BATCHES, CHANNELS, DEAD, REWARDS, TRAJECTORIES, WORK_QUEUES, Topology
from bus.worker import Worker, WorkerOptions
from schemas import Trajectories, encode
from tests.helpers import dead_letters, messages, reward, trajectory, wait_for

ROOT = Path(__file__).resolve().parent.parent
BODY_SECONDS = 60.0
"""A test body that has not finished by then is stuck (each takes seconds): fail it now, with
what it was waiting for, instead of at the 300 s test timeout."""


def run_bus(
    server: EmbeddedNats,
    topology: Topology,
    body: Callable[[JetStreamContext], Awaitable[None]],
    apply: bool = True,
) -> None:
    async def main() -> None:
        nc = await connect(server.url, "test")
        try:
            js = nc.jetstream()
            if apply:
                await topology.apply(js)
            try:
                await asyncio.wait_for(body(js), BODY_SECONDS)
            except TimeoutError:
                pytest.fail(
                    f"{body.__qualname__} did not finish in {BODY_SECONDS:.0f} s", pytrace=True
                )
        finally:
            await nc.close()

    asyncio.run(main())


async def run_until(worker: Worker, done: Callable[[], bool], timeout: float = 30.0) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "worker did not finish in time"
        assert not task.done(), task.exception() if task.done() else ""
        await asyncio.sleep(0.05)
    stop.set()
    try:
        await asyncio.wait_for(task, 15.0)
    except TimeoutError:
        pytest.fail("the worker did not return within 15 s of its stop (its drain is stuck)")


def test_apply_is_idempotent_and_declares_everything(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStreamContext) -> None:
        await topology.apply(js)  # second time: nothing to do, no error
        await topology.apply(js, update=True)
        for channel in CHANNELS:
            info = await js.stream_info(topology.stream(channel))
            assert info.config.duplicate_window == 3600.0
        for channel in WORK_QUEUES:
            queue = channel.work_queue
            info = await js.consumer_info(topology.stream(channel), queue.durable)
            assert info.config.ack_wait == queue.ack_wait
        await js.key_value(topology.kv_bucket)
        await js.object_store(topology.object_bucket)

    run_bus(nats_server, topology, body)


def test_same_event_published_twice_is_stored_once(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStreamContext) -> None:
        publisher = Publisher(js, topology)
        event = trajectory(topology.run)
        first = await publisher.publish(TRAJECTORIES, event)
        second = await publisher.publish(TRAJECTORIES, event)
        assert second.duplicate and not first.duplicate
        assert await messages(js, topology, TRAJECTORIES) == 1

    run_bus(nats_server, topology, body)


def test_publish_without_ack_is_retried_until_the_stream_takes_it(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """No stream yet: the async publish gets no ack, times out, and is retried as a request
    until the stream exists; then it is stored once and the caller gets the ack."""

    async def body(js: JetStreamContext) -> None:
        publisher = Publisher(js, topology, ack_timeout=0.3, retry_for=20.0)
        ack = await publisher.send(TRAJECTORIES, trajectory(topology.run))
        await asyncio.sleep(1.0)
        assert not ack.done()
        await topology.apply(js)
        stored = await asyncio.wait_for(ack, 10.0)
        assert stored.stream == topology.stream(TRAJECTORIES) and not stored.duplicate
        assert await messages(js, topology, TRAJECTORIES) == 1

    run_bus(nats_server, topology, body, apply=False)


def test_publish_the_stream_refuses_fails_after_retry_for(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """The server answers with an error (here: the stream is not the one the header expects).
    nats-py 2.16 leaves such an async publish pending forever; ours times out, retries, and
    fails with the server's reason once `retry_for` has passed."""

    async def body(js: JetStreamContext) -> None:
        publisher = Publisher(js, topology, ack_timeout=0.3, retry_for=1.0)
        data, started = encode(trajectory(topology.run)), time.monotonic()
        ack = await publisher.send_bytes(
            TRAJECTORIES, data, "x", headers={"Nats-Expected-Stream": "other"}
        )
        with pytest.raises(nats.js.errors.APIError, match="expected stream does not match"):
            await asyncio.wait_for(ack, 10.0)  # nats-py alone leaves this pending forever
        assert time.monotonic() - started < 5.0
        assert await messages(js, topology, TRAJECTORIES) == 0

    run_bus(nats_server, topology, body)


def test_a_closed_publisher_retries_what_awaits_its_ack_and_publishes_again(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """Closing stops the publisher's ack subscription: a publish still awaiting its ack is
    retried as a request (stored once), and a later publish subscribes again. The ack timeout
    is long, so only those two paths can settle them within the 5 s waited."""

    async def body(js: JetStreamContext) -> None:
        publisher = Publisher(js, topology, ack_timeout=30.0)
        ack = await publisher.send(TRAJECTORIES, trajectory(topology.run, prompt=0))
        await publisher.close()
        done, _ = await asyncio.wait([ack], timeout=5.0)
        assert done and ack.result().seq == 1, "a publish awaiting its ack at close was not settled"
        again = await publisher.send(TRAJECTORIES, trajectory(topology.run, prompt=1))
        done, _ = await asyncio.wait([again], timeout=5.0)
        assert done and again.result().seq == 2, "no ack for a publish after close"
        await publisher.close()
        assert await messages(js, topology, TRAJECTORIES) == 2

    run_bus(nats_server, topology, body)


def test_event_over_max_payload_is_refused_before_sending(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStreamContext) -> None:
        with pytest.raises(EventTooLarge, match="over the 8388608-byte max payload"):
            await Publisher(js, topology).publish(
                TRAJECTORIES, trajectory(topology.run, tokens=1 << 20)
            )
        assert await messages(js, topology, TRAJECTORIES) == 0

    run_bus(nats_server, topology, body)


def test_a_channel_takes_only_its_event_class_and_its_token(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """Publishing a reward on the trajectories channel, or a batch without its rank, is a
    caller's bug: refused before anything is sent, so no reader ever dead-letters it."""

    async def body(js: JetStreamContext) -> None:
        publisher = Publisher(js, topology)
        wrong = reward(topology.run)
        with pytest.raises(
            TypeError, match="channel trajectories carries Trajectories, not RewardEvent"
        ):
            await publisher.publish(TRAJECTORIES, wrong)  # type: ignore[misc]  # wrong on purpose
        with pytest.raises(TypeError, match="channel dead carries raw bytes"):
            await publisher.publish(DEAD, wrong)
        with pytest.raises(ValueError, match=r"channel batches takes one token \(rank\)"):
            await publisher.send_bytes(BATCHES, b"x", "x")
        with pytest.raises(ValueError, match="channel rewards takes no token"):
            await publisher.publish(REWARDS, wrong, 0)
        with pytest.raises(TypeError, match="a Channel of bus.topology"):
            topology.subject("trajectories")  # type: ignore[arg-type]
        assert [await messages(js, topology, c) for c in CHANNELS] == [0] * len(CHANNELS)

    run_bus(nats_server, topology, body)


def test_failing_handler_is_retried_with_delay_then_dead_lettered(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    attempts: list[float] = []

    async def handler(event: Trajectories, msg: Msg) -> None:
        attempts.append(time.monotonic())
        raise RuntimeError("reward model unavailable")

    event = trajectory(topology.run)

    async def body(js: JetStreamContext) -> None:
        publisher = Publisher(js, topology)
        await publisher.publish(TRAJECTORIES, event)
        options = WorkerOptions(max_deliver=3, nak_delay=0.3, fetch_timeout=0.2)
        worker = Worker(js, topology, TRAJECTORIES, handler, publisher, options)
        await run_until(worker, lambda: len(attempts) == 3 and publisher._inflight_bytes == 0)
        await asyncio.sleep(0.3)
        dead = await dead_letters(js, topology)
        assert dead == [
            (encode(event), "failed 3 times, last: RuntimeError: reward model unavailable")
        ]

    run_bus(nats_server, topology, body)
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert gaps[0] >= 0.25 and gaps[1] >= 0.55, gaps  # 0.3 s then 0.6 s


def test_a_worker_takes_no_more_messages_than_its_concurrency(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    # What it fetched but cannot run yet, no other worker can have: a newcomer would starve.
    handled: list[str] = []

    async def handler(event: Trajectories, msg: Msg) -> None:
        await asyncio.sleep(0.1)
        handled.append(event.id)

    async def body(js: JetStreamContext) -> None:
        publisher = Publisher(js, topology)
        for i in range(20):
            await publisher.publish(TRAJECTORIES, trajectory(topology.run, prompt=i))
        queue = TRAJECTORIES.work_queue
        worker = Worker(
            js, topology, TRAJECTORIES, handler, publisher, WorkerOptions(concurrency=2)
        )
        held: list[int] = []

        async def sample() -> None:
            while True:
                held.append(
                    (
                        await js.consumer_info(topology.stream(TRAJECTORIES), queue.durable)
                    ).num_ack_pending
                )
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        await run_until(worker, lambda: len(handled) == 20)
        sampler.cancel()
        # Twice the concurrency: the server may take the next pull request before the acks sent
        # ahead of it, so a message just acked can count a moment longer. Without the bound the
        # worker held 11 of these 20.
        assert max(held) <= 2 * 2, held

    run_bus(nats_server, topology, body)


def test_garbage_and_unknown_version_go_dead_and_worker_goes_on(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    handled: list[str] = []

    async def handler(event: Trajectories, msg: Msg) -> None:
        handled.append(event.id)

    good = trajectory(topology.run)
    future = msgpack.packb({**msgpack.unpackb(encode(good)), "schema_version": 7})

    async def body(js: JetStreamContext) -> None:
        publisher = Publisher(js, topology)
        subject = topology.subject(TRAJECTORIES)
        await js.publish(subject, b"\x00\xffnot an event")
        await js.publish(subject, future)
        await publisher.publish(TRAJECTORIES, good)
        worker = Worker(
            js, topology, TRAJECTORIES, handler, publisher, WorkerOptions(fetch_timeout=0.2)
        )
        await run_until(worker, lambda: bool(handled))
        await asyncio.sleep(0.3)
        reasons = sorted(reason for _, reason in await dead_letters(js, topology))
        assert reasons[0].startswith("jetrl.trajectory schema_version 7 is newer")
        assert reasons[1].startswith("not msgpack")
        assert handled == [good.id]

    run_bus(nats_server, topology, body)


def _spawn(url: str, run: str, mode: str, markers: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.worker_proc", url, run, mode, str(markers)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_killed_worker_message_is_redelivered_and_effect_happens_once(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    event = trajectory(topology.run)
    key = "effect." + event.id.replace("/", "_")

    async def setup(js: JetStreamContext) -> None:
        # A short ack wait so the redelivery comes quickly after the kill.
        config = topology.consumer_config(TRAJECTORIES.with_queue(ack_wait=1.5))
        await js.add_consumer(topology.stream(TRAJECTORIES), config)
        await Publisher(js, topology).publish(TRAJECTORIES, event)

    run_bus(nats_server, topology, setup)
    first = _spawn(nats_server.url, topology.run, "hang", tmp_path)
    wait_for(lambda: (tmp_path / key).exists(), timeout=20)
    first.send_signal(signal.SIGKILL)
    first.wait()
    second = _spawn(nats_server.url, topology.run, "fast", tmp_path)

    async def check(js: JetStreamContext) -> None:
        deadline = time.monotonic() + 20
        while True:
            info = await js.consumer_info(
                topology.stream(TRAJECTORIES), TRAJECTORIES.work_queue.durable
            )
            if info.num_ack_pending == 0 and info.num_pending == 0:
                break
            assert time.monotonic() < deadline, info
            await asyncio.sleep(0.1)
        assert info.num_redelivered >= 1 or info.delivered.consumer_seq >= 2
        entry = await (await js.key_value(topology.kv_bucket)).get(key)
        assert entry.value == b"done" and entry.revision is not None
        history = await (await js.key_value(topology.kv_bucket)).history(key)
        assert len(history) == 1  # written once, by the first worker

    try:
        run_bus(nats_server, topology, check, apply=False)
    finally:
        second.terminate()
        second.wait(10)


def test_sigterm_drains_in_flight_work_and_exits_zero(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    async def setup(js: JetStreamContext) -> None:
        publisher = Publisher(js, topology)
        for i in range(3):
            await publisher.publish(TRAJECTORIES, trajectory(topology.run, prompt=i))

    run_bus(nats_server, topology, setup)
    proc = _spawn(nats_server.url, topology.run, "slow", tmp_path)
    wait_for(lambda: any(tmp_path.iterdir()), timeout=20)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    started = {p.name for p in tmp_path.iterdir()}

    async def check(js: JetStreamContext) -> None:
        info = await js.consumer_info(
            topology.stream(TRAJECTORIES), TRAJECTORIES.work_queue.durable
        )
        assert info.num_ack_pending == 0  # everything it took was finished and acked
        kv = await js.key_value(topology.kv_bucket)
        done = {k for k in await kv.keys()}
        assert done == started
        assert info.num_pending + len(done) == 3

    run_bus(nats_server, topology, check)
    assert os.path.exists(tmp_path)


def test_streams_cli_applies_shows_and_deletes(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "ops.streams",
                *args,
                "--run",
                topology.run,
                "--nats",
                nats_server.url,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert "applied run" in cli("apply").stdout
    shown = cli("show").stdout
    assert f"RL_{topology.run}_PROMPTS" in shown and "rollout: pending 0, in flight 0" in shown
    assert (
        "limits from no config stored yet" in shown and "gate bound (max_staleness 1 + 1)" in shown
    )
    assert "deleted run" in cli("delete").stdout
    assert "(missing)" in cli("show").stdout
    bad = subprocess.run(
        [sys.executable, "-m", "ops.streams", "show", "--run", "a.b"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "run id 'a.b' must be 1-64 characters" in bad.stderr
