"""A two-hop publish -> consume -> publish -> consume chain, for the tracing tests.

`python -m tests.traced_chain URL RUN` runs it in a fresh process with tracing set up
from the environment (so OTEL_EXPORTER_OTLP_ENDPOINT decides where spans go).
"""

from __future__ import annotations

import asyncio
import sys

from nats.aio.msg import Msg

from bus import tracing
from bus.connection import connect
from bus.publisher import Publisher
from bus.topology import REWARDS, TRAJECTORIES, Topology
from bus.worker import Worker, WorkerOptions
from schemas import RewardEvent, Rewards, Trajectories
from tests.helpers import trajectory


async def chain(url: str, run: str) -> None:
    nc = await connect(url, "traced-chain")
    js = nc.jetstream()
    topology = Topology(run=run)
    await topology.apply(js)
    publisher = Publisher(js, topology)
    done = asyncio.Event()

    async def score(event: Trajectories, _msg: Msg) -> None:
        (sample,) = event.each()
        reward = RewardEvent(id=sample.id, run=run, trajectory=sample, reward=1.0)
        await publisher.publish(REWARDS, reward)

    async def collect(event: Rewards, _msg: Msg) -> None:
        done.set()

    with tracing.tracer.start_as_current_span("prompt", attributes={"jetrl.prompt_id": "p0"}):
        await publisher.publish(TRAJECTORIES, trajectory(run))
    stop = asyncio.Event()
    options = WorkerOptions(fetch_timeout=0.2)
    workers = [
        asyncio.create_task(
            Worker(js, topology, TRAJECTORIES, score, publisher, options).run(stop)
        ),
        asyncio.create_task(Worker(js, topology, REWARDS, collect, publisher, options).run(stop)),
    ]
    await asyncio.wait_for(done.wait(), 20)
    stop.set()
    await asyncio.gather(*workers)
    await nc.close()


if __name__ == "__main__":
    provider = tracing.setup("traced-chain")
    asyncio.run(chain(sys.argv[1], sys.argv[2]))
    if provider is not None:
        provider.shutdown()  # flushes the batch processor
