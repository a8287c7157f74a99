"""The worker's pulls through nats-py's public API (bus.pull) against a real nats-server.

What the worker does with a pulled message (ack, nak with a delay, in_progress, term, read
its delivery count and stream sequence) must work on messages of a plain inbox
subscription, and nothing in bus/ may lean on nats-py's private attributes: they pinned
the client to one minor version.
"""

from __future__ import annotations

import ast
import asyncio
import time
from pathlib import Path

import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.connection import JetStream, connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.pull import Puller, PullRefused
from bus.topology import TRAJECTORIES, Topology
from bus.worker import Worker, WorkerOptions
from schemas import Trajectories, encode
from tests.helpers import trajectory

ROOT = Path(__file__).resolve().parent.parent
ACK_WAIT = 2.0


def test_pulled_messages_ack_nak_term_and_heartbeat_like_jetstream_messages(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def main() -> None:
        nc = await connect(nats_server.url, "test-pull")
        js = nc.jetstream()
        await topology.apply(js)
        queue = TRAJECTORIES.work_queue
        stream = topology.stream(TRAJECTORIES)
        config = topology.consumer_config(TRAJECTORIES)
        config.ack_wait = ACK_WAIT  # short, so a failed heartbeat shows as a redelivery
        await js.add_consumer(stream, config)
        publisher = Publisher(js, topology)
        for i in range(4):
            await publisher.publish(TRAJECTORIES, trajectory(topology.run, prompt=i))
        puller = Puller(js, stream, queue.durable)
        await puller.open()
        try:
            first = await puller.fetch(4, 1.0)
            assert [(m.metadata.sequence.stream, m.metadata.num_delivered) for m in first] == [
                (1, 1),
                (2, 1),
                (3, 1),
                (4, 1),
            ]
            acked, termed, naked, held = first
            await acked.ack()
            await termed.term()
            await naked.nak(delay=0.3)
            naked_at = time.monotonic()

            async def beat() -> None:
                while True:
                    await held.in_progress()
                    await asyncio.sleep(0.25)

            beats = asyncio.create_task(beat())
            # Twice the ack wait: a message the heartbeat did not keep would be back by then.
            back: list[tuple[int, int, float]] = []
            deadline = time.monotonic() + 2 * ACK_WAIT
            while time.monotonic() < deadline:
                try:
                    msgs = await puller.fetch(4, 0.3)
                except nats.errors.TimeoutError:
                    continue
                for msg in msgs:
                    back.append(
                        (
                            msg.metadata.sequence.stream,
                            msg.metadata.num_delivered,
                            time.monotonic() - naked_at,
                        )
                    )
                    await msg.ack_sync()
            beats.cancel()
            assert [(seq, n) for seq, n, _ in back] == [(3, 2)], (
                "expected only the nak'ed message back, on its second delivery; got (seq, "
                f"delivery, after s) {back}"
            )
            assert back[0][2] >= 0.25, (
                f"the nak'ed message came back {back[0][2]:.2f} s after a 0.3 s delay"
            )
            await held.ack_sync()  # waits for the server, which consumer_info then reflects
            info = await js.consumer_info(stream, queue.durable)
            assert (info.num_ack_pending, info.num_pending) == (0, 0), info
        finally:
            await puller.close()
            await topology.delete(js)
            await nc.close()

    asyncio.run(main())


def test_a_message_carrying_its_own_status_header_is_handled_not_taken_for_a_status(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """A publisher may set any header; only the server's messages about a request (no ack
    reply subject) end it. Taken for a "404 No Messages", the event would sit delivered and
    unhandled until its ack wait, then again on every redelivery."""
    handled: list[str] = []

    async def handler(event: Trajectories, _msg: Msg) -> None:
        handled.append(event.id)

    async def main() -> None:
        nc = await connect(nats_server.url, "test-pull-status")
        js = nc.jetstream()
        await topology.apply(js)
        event = trajectory(topology.run)
        await js.publish(
            topology.subject(TRAJECTORIES),
            encode(event),
            headers={"Status": "404", "Description": "No Messages"},
        )
        worker = Worker(
            js,
            topology,
            TRAJECTORIES,
            handler,
            Publisher(js, topology),
            WorkerOptions(fetch_timeout=0.2),
        )
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        deadline = time.monotonic() + 10
        while not handled and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 15)
        await topology.delete(js)
        await nc.close()
        assert handled == [event.id], (
            "the event with a 'Status: 404' header of its own was not handled in 10 s"
        )

    asyncio.run(main())


def test_a_pull_is_given_up_when_the_connection_drops_not_at_its_deadline(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """A request sent just before its server died was lost with it, and the worker waited out
    the request's 10 s deadline at each kill of a cluster node. Here the connection is dropped
    (and made again) under a long poll that has 40 s left: the pull must end at once."""

    async def main() -> None:
        nc = await connect(nats_server.url, "test-pull-drop")
        js = nc.jetstream()
        await topology.apply(js)
        puller = Puller(js, topology.stream(TRAJECTORIES), TRAJECTORIES.work_queue.durable)
        await puller.open()
        try:
            polling = asyncio.create_task(puller.pull({"batch": 1, "expires": 30 * 10**9}, 40.0))
            await asyncio.sleep(0.5)
            assert not polling.done()
            dropped_at = time.monotonic()
            await nc.force_reconnect()
            done, _ = await asyncio.wait([polling], timeout=5.0)
            assert done, "the pull went on waiting after its connection dropped"
            assert isinstance(polling.exception(), nats.errors.TimeoutError), polling
            assert time.monotonic() - dropped_at < 5.0
        finally:
            await puller.close()
            await topology.delete(js)
            await nc.close()

    asyncio.run(main())


def test_a_worker_and_a_publisher_refuse_a_context_that_does_not_keep_its_connection() -> None:
    topology = Topology(run="refused")
    plain = JetStreamContext(Client())

    async def handler(event: Trajectories, _msg: Msg) -> None:
        pass

    with pytest.raises(TypeError, match=r"bus\.connection\.connect"):
        Worker(plain, topology, TRAJECTORIES, handler, Publisher(JetStream(Client()), topology))
    with pytest.raises(TypeError, match=r"bus\.connection\.connect"):
        Publisher(plain, topology)
    assert isinstance(JetStream(Client()), JetStreamContext)


def test_bus_uses_no_private_attribute_of_another_object() -> None:
    """bus/ talks to nats-py only through its public API: a private attribute (`js._nc`,
    `sub._pending_queue`) can change in any release and pinned the client to one minor
    version. Only an object's own (`self._x`) are allowed, and the standard library's public
    functions whose names start with an underscore (`os._exit`)."""
    documented = {"os._exit"}
    reached = []
    for path in sorted((ROOT / "bus").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            private = (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            )
            own = (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            )
            if (
                isinstance(node, ast.Attribute)
                and private
                and not own
                and ast.unparse(node) not in documented
            ):
                reached.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not reached, f"private attributes reached: {reached}"


def test_a_pull_the_server_refuses_at_once_raises_instead_of_returning_nothing(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """Past the consumer's max_waiting the server ends a long poll at once with "409 Exceeded
    MaxWaiting". Returned as an empty list, the worker's next request went out at once: each
    refused worker spun on requests (docs/scale.md: above 512 waiting rollout workers)."""

    async def main() -> None:
        nc = await connect(nats_server.url, "test-pull-refused")
        js = nc.jetstream()
        await topology.apply(js)
        stream = topology.stream(TRAJECTORIES)
        config = topology.consumer_config(TRAJECTORIES)
        config.durable_name, config.max_waiting = "refusing", 1
        await js.add_consumer(stream, config)
        waiting, refused = (Puller(js, stream, "refusing") for _ in "ab")
        await waiting.open()
        await refused.open()
        try:
            # The one waiting request the consumer allows (the stream is empty: it waits).
            held = asyncio.create_task(waiting.fetch(1, 5.0))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            with pytest.raises(PullRefused, match="Exceeded MaxWaiting"):
                await refused.fetch(1, 3.0)
            assert time.monotonic() - started < 1.0, "the refusal is the server's, not a wait"
            held.cancel()
        finally:
            await waiting.close()
            await refused.close()
            await nc.close()

    asyncio.run(main())
