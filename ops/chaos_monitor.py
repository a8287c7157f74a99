"""What `ops.chaos` sees of a run from outside it: the messages on its subjects as they are
sent, when each trainer step's metrics appeared, and which micro-batches of each step went out.

    Monitor.start       a core subscription per data flow (and the metrics keys)
    Monitor.next(kind)  a future for the next message of kind that passes a test
    first_output        the test that a message is a replacement's work, not its victim's
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg

from bus.readers import Tap
from bus.topology import (
    BATCHES,
    PROMPTS,
    REWARDS,
    TRAJECTORIES,
    Topology,
    metrics_prefix,
)
from schemas import BatchEvent, DecodeError, decode


class Monitor:
    """What the driver sees of a run: every message published on its subjects (a core
    subscription sees each as it is sent), when each trainer step's metrics first appeared,
    and which micro-batches of each step were sent."""

    def __init__(self, nc: Client, topology: Topology) -> None:
        self.nc, self.topology = nc, topology
        self.steps: dict[int, float] = {}
        self.trained_at: list[float] = []
        """When each step's metrics were written, retrained steps again."""
        self.micro: dict[int, set[tuple[int, int]]] = {}
        """Per step, the (rank, micro index) of each micro-batch sent."""
        self.micro_count: dict[int, int] = {}
        self.waiters: list[tuple[str, Callable[[bytes], bool], asyncio.Future[bytes]]] = []
        self.tap: Tap | None = None

    async def start(self) -> None:
        t = self.topology
        subjects = {c.name: t.subjects(c) for c in (PROMPTS, TRAJECTORIES, REWARDS, BATCHES)}
        subjects["metrics"] = f"$KV.{t.kv_bucket}.{metrics_prefix(0)}>"
        self.tap = Tap(self.nc, subjects, self._seen)
        await self.tap.open()

    async def stop(self) -> None:
        if self.tap is not None:
            await self.tap.close()

    async def _seen(self, kind: str, msg: Msg) -> None:
        if kind == "metrics":
            self.steps.setdefault(json.loads(msg.data)["step"], time.time())
            self.trained_at.append(time.time())
        elif kind == "batches":
            with contextlib.suppress(DecodeError):
                batch = decode(msg.data, BatchEvent)
                self.micro.setdefault(batch.step, set()).add((batch.dp_rank, batch.micro_index))
                self.micro_count[batch.step] = batch.micro_count * batch.dp_size
        for waiter in [w for w in self.waiters if w[0] == kind and w[1](msg.data)]:
            self.waiters.remove(waiter)
            if not waiter[2].done():
                waiter[2].set_result(msg.data)

    def next(
        self, kind: str, accept: Callable[[bytes], bool] = lambda _: True
    ) -> asyncio.Future[bytes]:
        """The next message of `kind` that `accept`s (registered now, before any await)."""
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.waiters.append((kind, accept, future))
        return future

    @property
    def last_step(self) -> int:
        return max(self.steps, default=-1)

    def steps_per_s(self) -> float:
        """Steps from the first to the last step's metrics, per second (start-up left out)."""
        times = sorted(self.steps.values())
        return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def first_output(kind: str, killed: int | None, step: int) -> Callable[[bytes], bool]:
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
