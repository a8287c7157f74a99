"""Who is working on a run: one heartbeat entry per worker process in the run's members bucket.

The bucket (`Topology.members_bucket`) has a TTL, so the keys in it are the live processes:
an entry not refreshed within the TTL expires (a killed process disappears by itself), and
a process that exits cleanly deletes its own. Each entry is a `Member` record
(`schemas.kv_records`; its key family: `bus.channels.MEMBERS`).

    join: first entry written (visible as soon as `attach` returns)
    loop: every TTL/5 s, or at once after `report(...)` -> put the entry again

The heartbeat period is read from the bucket's TTL, so a bucket declared with a short TTL
(tests) gets quick heartbeats with no flag on any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from bus.connection import worker_id
from bus.tasks import cancel_until_done
from bus.topology import Topology
from schemas.kv_records import Member

log = logging.getLogger("jetrl.membership")

BEATS_PER_TTL = 5
"""Heartbeats per TTL: an entry survives a few lost heartbeats (a reconnect) before it expires."""


def member_key(worker: str) -> str:
    """A valid KV key for a worker id (host:pid:role): ':' and any other character KV refuses become
    '_'."""
    return re.sub(r"[^-_=A-Za-z0-9]", "_", worker)


class Membership:
    """This process's entry in the members bucket, refreshed until `leave`."""

    def __init__(self, kv: KeyValue, role: str, interval: float, worker: str | None = None) -> None:
        """`worker`: the id of the member when one process runs several (a simulated fleet,
        `ops.bench.scale_workers`); default the process's `worker_id(role)`."""
        now = time.time()
        self.kv = kv
        self.interval = interval
        self.key = member_key(worker or worker_id(role))
        self.member = Member(
            role=role, node=socket.gethostname(), pid=os.getpid(), started_at=now, updated_at=now
        )
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def join(
        cls,
        js: JetStreamContext,
        topology: Topology,
        role: str,
        background: bool = True,
        worker: str | None = None,
    ) -> Membership:
        """Write the first entry; heartbeat from a task of its own if `background`, else the
        caller runs `beat()` (a stage runs it under its TaskGroup, where a failure is seen)."""
        kv = await js.key_value(topology.members_bucket)
        ttl = (await kv.status()).ttl or topology.member_ttl
        membership = cls(kv, role, interval=ttl / BEATS_PER_TTL, worker=worker)
        await membership.put()
        if background:
            membership.beat_in_background()
        return membership

    def beat_in_background(self) -> None:
        """Heartbeat from a task of this object's own (a process with no stage runner)."""
        self._task = asyncio.create_task(self.beat())

    @property
    def background(self) -> bool:
        """Whether the heartbeat runs as a task of its own (else the caller runs `beat`)."""
        return self._task is not None

    def report(self, *, engine: str | None = None, weight_version: int | None = None) -> None:
        """Record what this worker runs or serves; the entry is rewritten now,
        not at the next beat."""
        if engine is not None:
            self.member = self.member.model_copy(update={"engine": engine})
        if weight_version is not None:
            self.member = self.member.model_copy(update={"weight_version": weight_version})
        self._changed.set()

    async def beat(self) -> None:
        """Rewrite the entry every `interval` s, or at once after `report`, until cancelled."""
        while True:
            # Not asyncio.wait_for: on 3.11 it swallows a cancel that lands as the event is
            # set (a `report` just before a stage stops), and this loop then never ended.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._changed.wait()
            self._changed.clear()
            try:
                await self.put()
            except (
                nats.errors.Error
            ) as exc:  # reconnecting: the work goes on, the next beat retries
                log.warning("membership heartbeat failed: %s", exc)

    async def put(self) -> None:
        """Write the entry now, with the time of writing."""
        self.member = self.member.model_copy(update={"updated_at": time.time()})
        await self.kv.put(self.key, self.member.encode())

    async def leave(self) -> None:
        """Stop heartbeating and delete the entry (should that fail, it expires after the TTL)."""
        if self._task is not None:
            await cancel_until_done([self._task])  # mid-put, the beat can swallow one cancel
        try:
            await self.kv.delete(self.key)
        except nats.errors.Error as exc:
            log.warning("membership entry not deleted (it expires by itself): %s", exc)


async def stored_keys(js: JetStreamContext, bucket: str, pattern: str = ">") -> list[str]:
    """The keys of a KV bucket matching `pattern` (NATS wildcards), from one stream-info request.

    Not `KeyValue.keys()`: nats-py's listing can end before the first key arrives (its end marker
    races the delivery), and under load a live run read as having no workers. A deleted key may
    be listed (its marker is stored until it ages out): reading it says so."""
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.{pattern}")
    return [subject.removeprefix(f"$KV.{bucket}.") for subject in info.state.subjects or {}]


async def live_members(js: JetStreamContext, topology: Topology) -> list[Member]:
    """Every worker of the run whose heartbeat has not expired, by role, node and pid."""
    kv = await js.key_value(topology.members_bucket)
    members = []
    for key in await stored_keys(js, topology.members_bucket):
        try:
            entry = await kv.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            continue  # expired or left since the listing
        members.append(Member.decode(entry.value))
    return sorted(members, key=lambda m: (m.role, m.node, m.pid))


async def member_ids(js: JetStreamContext, topology: Topology, role: str) -> list[str]:
    """The worker ids (host:pid:role, `bus.connection.worker_id`) of `role`'s live members."""
    return [
        f"{m.node}:{m.pid}:{m.role}" for m in await live_members(js, topology) if m.role == role
    ]
