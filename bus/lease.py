"""One owner of "who holds device D now", for `placement: colocated`: a rollout engine and a
trainer that share a node's device take turns on it, in phases (`schemas.kv_records.Phase`).

The state is one KV entry per device, `lease.<device>` (`DeviceLease`), changed only by
compare-and-set on its revision, so two processes can never both believe they took it. The
lease is tied to its holder's liveness the way membership is: the holder is named by its
members-bucket key, and a holder whose entry has expired (killed: no heartbeat for the
bucket's TTL) or been deleted (it left) holds nothing; the next taker overwrites it.

    acquire(phase):  read -> decide (pure: `decide`) ->
                       free / holder dead  -> compare-and-set {holder: me, phase}   -> return
                       mine                -> return
                       held by a live one  -> mark it wanted (so the holder hands it over at
                                              its next boundary), poll again; say why after
                                              `SAY_AFTER` s of waiting (nothing waits silently)
    wanted():        whether another phase waits (the holder releases at its next boundary)
    release():       compare-and-set {holder: None} (what is wanted stays marked)

`decide` and `hand_over` are the decisions, apart from the I/O (as `producers.gate`). This
module knows no stage: the stages wrap their phases in it (`consumers.colocation`).

A holder whose heartbeat stops while it still runs (a partition longer than the members TTL)
can be overtaken while it computes; `holds()` lets it check before each phase.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from enum import Enum

from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from bus.membership import member_key
from schemas.kv_records import DeviceLease, Phase

log = logging.getLogger("jetrl.lease")

SAY_AFTER = 30.0
"""Seconds of waiting for a device before the wait is logged (then again every as long)."""


class Verdict(Enum):
    TAKE = "take"
    MINE = "mine"
    WAIT = "wait"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str


def decide(
    record: DeviceLease | None, me: str, holder_alive: bool, wanter_alive: bool = True
) -> Decision:
    """Whether `me` may take the device whose lease is `record` (None: never taken);
    `holder_alive`, `wanter_alive`: whether the holder's and the waiter's membership entries
    are still there. A device released while another process waits for it is that process's:
    the one that released it does not take it straight back (no phase starves)."""
    if record is None or record.holder is None:
        if record is not None and record.wanted_by not in (None, me) and wanter_alive:
            return Decision(Verdict.WAIT, f"free, promised to {record.wanted_by}")
        return Decision(Verdict.TAKE, "free")
    if record.holder == me:
        return Decision(Verdict.MINE, f"already held, in phase {record.phase}")
    if not holder_alive:
        return Decision(
            Verdict.TAKE, f"holder {record.holder} is gone (its membership expired): taken over"
        )
    return Decision(
        Verdict.WAIT,
        f"held by {record.holder} in phase {record.phase} for {time.time() - record.since:.0f} s",
    )


def hand_over(record: DeviceLease | None, me: str) -> bool:
    """Whether `me`, holding the device, should release it at its next boundary: another
    process waits for it."""
    return (
        record is not None
        and record.holder == me
        and record.wanted is not None
        and record.wanted_by != me
    )


def lease_key(device: str) -> str:
    """The KV key of `device`'s lease (any characters KV refuses become '_')."""
    return f"lease.{member_key(device)}"


class Lease:
    """This process's side of one device's lease: `me` is its members-bucket key."""

    def __init__(
        self, kv: KeyValue, members: KeyValue, device: str, me: str, poll: float = 0.05
    ) -> None:
        self.kv, self.members, self.device, self.me, self.poll = kv, members, device, me, poll
        self.key = lease_key(device)

    async def read(self) -> tuple[DeviceLease | None, int]:
        """The stored lease and its revision (None, 0: never written)."""
        try:
            entry = await self.kv.get(self.key)
        except (KeyNotFoundError, KeyDeletedError):
            return None, 0
        return DeviceLease.decode(entry.value), entry.revision or 0

    async def alive(self, holder: str) -> bool:
        try:
            await self.members.get(holder)
        except (KeyNotFoundError, KeyDeletedError):
            return False
        return True

    async def write(self, record: DeviceLease, revision: int) -> bool:
        """Compare-and-set: False when someone wrote the entry since `revision`."""
        try:
            if revision == 0:
                await self.kv.create(self.key, record.encode())
            else:
                await self.kv.update(self.key, record.encode(), last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def acquire(self, phase: Phase) -> float:
        """Hold the device for `phase`; returns the seconds waited for it."""
        started = said = time.monotonic()
        while True:
            record, revision = await self.read()
            holder = None if record is None else record.holder
            wanter = None if record is None else record.wanted_by
            decision = decide(
                record,
                self.me,
                holder is None or await self.alive(holder),
                wanter in (None, self.me) or await self.alive(wanter),
            )
            if decision.verdict is Verdict.WAIT:
                assert record is not None
                if record.holder is not None and (
                    record.wanted_by != self.me or record.wanted != phase
                ):
                    marked = record.model_copy(update={"wanted": phase, "wanted_by": self.me})
                    await self.write(marked, revision)  # lost to a write: marked next poll
                if time.monotonic() - said > SAY_AFTER:
                    said = time.monotonic()
                    log.warning(
                        "phase %s waits for device %s: %s", phase, self.device, decision.reason
                    )
                await asyncio.sleep(self.poll)
                continue
            if decision.verdict is Verdict.MINE and record is not None and record.phase == phase:
                return time.monotonic() - started
            if decision.verdict is Verdict.TAKE and decision.reason != "free":
                log.warning("device %s: %s", self.device, decision.reason)
            # Taking clears what was wanted: the waiter that took it is served.
            taken = DeviceLease(holder=self.me, phase=phase, since=time.time())
            if await self.write(taken, revision):
                return time.monotonic() - started

    async def wanted(self) -> bool:
        """Whether another process waits for the device this one holds."""
        record, _ = await self.read()
        return hand_over(record, self.me)

    async def holds(self) -> bool:
        """Whether this process holds the device (not overtaken as dead meanwhile)."""
        record, _ = await self.read()
        return record is not None and record.holder == self.me

    async def release(self) -> None:
        """Free the device, if this process holds it (what is wanted stays marked)."""
        while True:
            record, revision = await self.read()
            if record is None or record.holder != self.me:
                return
            free = record.model_copy(update={"holder": None, "phase": None, "since": time.time()})
            if await self.write(free, revision):
                return
