"""A reward-queue worker run as a real subprocess by the bus tests.

Its handler's effect is idempotent: `kv.create(<event id>)` succeeds only once per id.
    python -m tests.worker_proc URL RUN MODE MARKER_DIR
MODE hang: after the effect, write MARKER_DIR/<id> and hang (to be SIGKILLed before the ack).
MODE slow: write MARKER_DIR/<id>, sleep 2 s, then do the effect (to be SIGTERMed mid-way).
MODE fast: do the effect.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError

from bus.connection import connect
from bus.publisher import Publisher
from bus.topology import TRAJECTORIES, Topology
from bus.worker import Worker, WorkerOptions, stop_on_signals
from schemas import Trajectories


async def main(url: str, run: str, mode: str, markers: Path) -> None:
    nc = await connect(url, f"test-worker-{mode}")
    js = nc.jetstream()
    topology = Topology(run=run)
    kv = await js.key_value(topology.kv_bucket)

    async def handler(event: Trajectories, _msg: Msg) -> None:
        key = "effect." + event.id.replace("/", "_")
        if mode == "slow":
            (markers / key).touch()
            await asyncio.sleep(2.0)
        try:
            await kv.create(key, b"done")
        except KeyWrongLastSequenceError:
            pass  # already done by an earlier delivery: the effect happens once
        if mode == "hang":
            (markers / key).touch()
            await asyncio.sleep(3600)

    stop = asyncio.Event()
    stop_on_signals(stop)
    worker = Worker(
        js, topology, TRAJECTORIES, handler, Publisher(js, topology), WorkerOptions(concurrency=4)
    )
    print("ready", flush=True)
    await worker.run(stop)
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])))
