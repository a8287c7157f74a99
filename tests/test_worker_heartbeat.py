"""The worker loop keeps a long handler's message its own: `in_progress` heartbeats.

A handler may run far longer than its consumer's ack_wait (a long generation, a slow reward):
the loop tells the server every ack_wait/3 that the message is still being worked on, so it
is not handed out again meanwhile. Here a real worker runs over a real queue whose consumer
the server has with a 1 s ack_wait, while the handler takes four times that; the message
must be delivered once.

The channel the worker is given says 60 s, as a queue declared by another process with
the default would: the worker must pace its heartbeats by what the server has, not by it.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.topology import PROMPTS, Topology
from bus.worker import Worker, WorkerOptions
from schemas import PromptEvent, Tensor, encode

ACK_WAIT = 1.0
"""The consumer's ack_wait on the server."""
HANDLER_SECONDS = 4 * ACK_WAIT
"""How long the handler works on its message: more than 3 ack_waits."""
CHANNEL = PROMPTS.with_queue(durable="slow", ack_wait=60.0, max_ack_pending=16)
QUEUE = CHANNEL.work_queue


def test_a_handler_running_past_ack_wait_keeps_its_message(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def main() -> None:
        nc = await connect(nats_server.url, "test-heartbeat")
        try:
            js = nc.jetstream()
            await topology.apply(js)
            await run(js, topology)
        finally:
            await topology.delete(nc.jetstream())
            await nc.close()

    asyncio.run(main())


async def run(js: JetStreamContext, topology: Topology) -> None:
    stream = topology.stream(CHANNEL)
    await js.add_consumer(stream, topology.consumer_config(CHANNEL.with_queue(ack_wait=ACK_WAIT)))
    deliveries: list[int] = []
    finished = asyncio.Event()

    async def handler(event: PromptEvent, msg: Msg) -> None:
        deliveries.append(msg.metadata.num_delivered)
        if (
            msg.metadata.num_delivered == 1
        ):  # a redelivered copy returns at once: it is already a failure
            await asyncio.sleep(HANDLER_SECONDS)
            finished.set()

    prompt = PromptEvent(
        id=f"{topology.run}/0/0",
        run=topology.run,
        epoch=0,
        index=0,
        token_ids=Tensor.from_numpy(np.array([1, 2], np.int32)),
    )
    await js.publish(topology.subject(PROMPTS), encode(prompt))
    stop = asyncio.Event()
    worker = Worker(
        js, topology, CHANNEL, handler, Publisher(js, topology), WorkerOptions(fetch_timeout=0.2)
    )
    loop = asyncio.create_task(worker.run(stop))
    most_redelivered = 0
    try:
        deadline = time.monotonic() + HANDLER_SECONDS + 20
        while not finished.is_set():  # watch the consumer while the handler works
            assert time.monotonic() < deadline, "the handler never finished"
            assert not loop.done(), (
                f"the worker loop ended: {loop.exception() if loop.done() else ''}"
            )
            most_redelivered = max(
                most_redelivered, (await js.consumer_info(stream, QUEUE.durable)).num_redelivered
            )
            await asyncio.sleep(0.1)
        while (info := await js.consumer_info(stream, QUEUE.durable)).ack_floor.stream_seq < 1:
            assert time.monotonic() < deadline, "the message was never acked"
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(loop, 10)
    assert deliveries == [1], (
        f"the message was handed out {len(deliveries)} times (delivery counts {deliveries}) while "
        f"its {HANDLER_SECONDS:.0f} s handler ran over a {ACK_WAIT:.0f} s ack_wait: no in_progress "
        "heartbeat held it"
    )
    assert most_redelivered == 0 and info.delivered.consumer_seq == 1, (
        f"the server redelivered it: {most_redelivered} redelivered, "
        f"{info.delivered.consumer_seq} deliveries"
    )


def test_a_worker_fetches_only_while_its_fetching_event_is_set(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """`Worker.fetching` (a trainer's lent rollout, `consumers.lending`): cleared, the worker
    takes nothing from its queue, which stays there for others; set, it takes the message."""
    channel = PROMPTS.with_queue(durable="lent", ack_wait=5.0, max_ack_pending=16)

    async def main() -> None:
        nc = await connect(nats_server.url, "test-fetching")
        js = nc.jetstream()
        await topology.apply(js)
        try:
            await js.add_consumer(topology.stream(channel), topology.consumer_config(channel))
            handled: list[str] = []

            async def handler(event: PromptEvent, msg: Msg) -> None:
                handled.append(event.id)

            prompt = PromptEvent(
                id=f"{topology.run}/0/0",
                run=topology.run,
                epoch=0,
                index=0,
                token_ids=Tensor.from_numpy(np.array([1, 2], np.int32)),
            )
            await js.publish(topology.subject(PROMPTS), encode(prompt))
            fetching, stop = asyncio.Event(), asyncio.Event()
            options = WorkerOptions(fetch_timeout=0.2)
            publisher = Publisher(js, topology)
            worker = Worker(js, topology, channel, handler, publisher, options, fetching=fetching)
            loop = asyncio.create_task(worker.run(stop))
            await asyncio.sleep(1.0)
            info = await js.consumer_info(topology.stream(channel), channel.work_queue.durable)
            assert handled == [] and info.num_pending == 1, "fetched while not fetching"
            fetching.set()
            for _ in range(100):
                if handled:
                    break
                await asyncio.sleep(0.05)
            assert handled == [prompt.id]
            stop.set()
            await asyncio.wait_for(loop, 10.0)
        finally:
            await topology.delete(js)
            await nc.close()

    asyncio.run(main())
