"""Trainer ranks 1..n-1 of a collective broadcast: each sends the buckets of the tensors it owns.

Rank 0's `CollectiveSource` coordinates every attempt (plan, check-ins, start, outcome) in its
TCPStore; a peer follows it there, as a receiver does, but never checks in: the senders are
always part of the group (ranks 0..senders-1, the rollout workers after them). Per attempt:

    plan     poll `vV/aA/plan` (its buckets say which are this rank's)
    start    poll `vV/aA/start`: no members -> nothing to send; else join the epoch's group
             (a new one whenever the epoch changes: after a failure or a membership change)
    data     `send_buckets`: its own buckets packed from its tensors, the others' received and
             dropped
    failure  wait for the source's outcome: `retry` -> the next attempt; anything else -> done

A peer that dies makes the attempt fail for everyone (the group needs every sender); the
source retries, then gives up, and the workers catch up from the stored fallback copy.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from engines.collective_group import (
    CollectiveSettings,
    Published,
    _drop,
    _Group,
    _open_group,
    _poll,
    send_buckets,
)


class CollectivePeer:
    """Trainer rank `rank` (>= 1) of the senders: takes part in the broadcasts rank 0
    coordinates."""

    def __init__(self, rank: int, settings: CollectiveSettings) -> None:
        if rank < 1:
            raise ValueError(
                f"a peer is trainer rank 1 or above (rank 0 is the source), not {rank}"
            )
        self.rank, self._s = rank, settings
        self._address: tuple[str, int] | None = None
        self._store: dist.TCPStore | None = None
        self._group: _Group | None = None
        self._bufs = [torch.empty(0, dtype=torch.uint8, device=settings.device)] * 2

    def publish(
        self, address: tuple[str, int], version: int, tensors: Mapping[str, torch.Tensor]
    ) -> Published:
        """Send this rank's `tensors` of `version` in the broadcast the source at `address` runs;
        returns once the source delivered it or gave up (never hangs: every wait is bounded)."""
        started, s = time.monotonic(), self._s
        try:
            if self._store is None or self._address != tuple(address):
                self.close()
                t = timedelta(seconds=s.join_timeout_s)
                self._store = dist.TCPStore(address[0], address[1], None, False, t)
                # tuple(): the address may come as a JSON list.
                self._address = cast(tuple[str, int], tuple(address))
            return self._attempts(self._store, version, tensors, started)
        except RuntimeError as exc:  # the store went away: rank 0 died or closed
            self.close()
            reason = f"source unreachable: {str(exc).splitlines()[0][:200]}"
            return Published(version, 0, (), 0, time.monotonic() - started, 0, reason)

    def _attempts(
        self,
        store: dist.TCPStore,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        started: float,
    ) -> Published:
        s, reason, attempt, sent = self._s, "no plan from the source in time", 0, 0
        for attempt in range(s.max_attempts):
            key = f"v{version}/a{attempt}"
            raw = _poll(store, f"{key}/plan", s.join_timeout_s)
            if raw is None:
                break
            plan = json.loads(raw)
            if plan["senders"] <= self.rank:
                reason = f"the source has {plan['senders']} senders, this is rank {self.rank}"
                break
            start = json.loads(
                _poll(store, f"{key}/start", 2 * s.join_timeout_s + s.op_timeout_s)
                or '{"members": []}'
            )
            members, epoch = tuple(start["members"]), start.get("epoch", -1)
            if not members:
                reason = "no member checked in"
                break
            try:
                if (
                    self._group is None
                    or self._group.epoch != epoch
                    or self._group.members != members
                ):
                    _drop(self._group)
                    self._group = None
                    prefix = dist.PrefixStore(f"epoch{epoch}/", store)
                    size = plan["senders"] + len(members)
                    self._group = _Group(epoch, members, _open_group(prefix, self.rank, size, s))
                sent, self._bufs = send_buckets(
                    self._group, self.rank, plan, tensors, self._bufs, s
                )
            except (RuntimeError, TimeoutError) as exc:
                _drop(self._group)
                self._group, sent = None, 0
                reason = f"attempt {attempt} failed: {str(exc).splitlines()[0][:200]}"
            # Our part went through or not, the source decides:
            # a member may have failed it after our last bucket.
            outcome = _poll(
                store, f"{key}/outcome", s.op_timeout_s + s.join_timeout_s + 2 * s.join_timeout_s
            )
            if outcome == "delivered":
                return Published(
                    version,
                    epoch,
                    members,
                    attempt + 1,
                    time.monotonic() - started,
                    plan["total"],
                    sent=sent,
                )
            if outcome != "retry":
                reason = (
                    f"the source ended v{version} ({outcome or 'no outcome in time'}): {reason}"
                )
                break
        return Published(version, 0, (), attempt + 1, time.monotonic() - started, 0, reason)

    def close(self) -> None:
        _drop(self._group)
        self._group, self._store, self._address = None, None, None
