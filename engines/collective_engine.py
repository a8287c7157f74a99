"""A rollout worker's side of a collective broadcast that ends in the engines' own memory.

The worker follows the source's control plane as `engines.collective.CollectiveReceiver` does
(plan, check-in, start, outcome, in the source's TCPStore) but receives nothing itself: it
checks in as `engine:<ranks>` (the sum of its engine copies' `weight_ranks`), and once the
start names it, has every copy join the epoch's group through the engine's own call
(`GroupWeights.join_weights_group`: SGLang's `init_weights_update_group`) and take the
broadcast with the engine's own call (`receive_weights`: `update_weights_from_distributed`),
all copies at once (a collective needs every rank), each loading and reading back what came.

Every wait is bounded: the engines' calls run in threads of their own, watched with a
deadline (the attempt's op timeout per tensor, plus a grace) and against the source's
outcome (a `retry` or `gave_up` written while they wait ends the wait). Any failure is
`Missed`, and the caller loads the stored fallback copy whole: a failed or refused join, a
broadcast that broke (the source retried without this worker, or gave up), a read-back that
disagrees (`WeightsNotLoaded`: the version arrived, but the engine does not hold it), a plan
the engines cannot take (several trainer ranks send; the slots are not the manifest).
An engine call still running after its deadline is left to its own group's timeout; the
copies' threads are not reused until it ends (`busy`).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import cast

import torch.distributed as dist

from engines.collective_group import _GRACE_S, CollectiveSettings, Missed, _poll, _until
from engines.collective_tensors import ENGINE, place
from engines.weights_group import GroupWeights


class Delivered:
    """The version is in every engine copy, each load read back."""

    def __init__(self, version: int, seconds: float, nbytes: int, epoch: int) -> None:
        self.version, self.seconds, self.nbytes, self.epoch = version, seconds, nbytes, epoch


class EngineReceiver:
    """Takes versions by broadcast into `engines` (every copy a `GroupWeights`)."""

    def __init__(
        self, member_id: str, settings: CollectiveSettings, engines: Sequence[GroupWeights]
    ) -> None:
        self.member_id, self._s, self.engines = member_id, settings, list(engines)
        self._address: tuple[str, int] | None = None
        self._store: dist.TCPStore | None = None
        self.group: str | None = None
        """The weight-update group the copies are in (its name), or None."""
        self._pool = ThreadPoolExecutor(len(self.engines), thread_name_prefix="weights-group")
        self._running: list[Future[None]] = []

    @property
    def ranks(self) -> int:
        return sum(e.weight_ranks for e in self.engines)

    def busy(self) -> bool:
        """An engine call from an abandoned attempt is still running."""
        self._running = [f for f in self._running if not f.done()]
        return bool(self._running)

    def receive(
        self, address: tuple[str, int], version: int, checksums: Mapping[str, str]
    ) -> Delivered | Missed:
        """Take part in `version`'s broadcast from the source at `address`; `checksums`: the
        event's manifest (name -> sha256), which the plan's slots must name exactly."""
        started, t = time.monotonic(), timedelta(seconds=self._s.join_timeout_s)
        if self.busy():
            return Missed(version, "an engine is still in a call from an abandoned broadcast")
        try:
            if self._store is None or self._address != tuple(address):
                self._store, self.group = None, None
                self._store = dist.TCPStore(address[0], address[1], None, False, t)
                self._address = cast(tuple[str, int], tuple(address))
            return self._attempts(self._store, version, checksums, started)
        except RuntimeError as exc:  # the store went away: the source died or closed
            self._store, self._address, self.group = None, None, None
            return Missed(version, f"source unreachable: {str(exc).splitlines()[0][:200]}")

    def _attempts(
        self, store: dist.TCPStore, version: int, checksums: Mapping[str, str], started: float
    ) -> Delivered | Missed:
        s, superseded = self._s, lambda: int(store.get("latest")) > version
        for attempt in range(s.max_attempts):
            key = f"v{version}/a{attempt}"
            raw = _poll(store, f"{key}/plan", s.join_timeout_s, superseded)
            if raw is None:
                why = "superseded by a newer version" if superseded() else "no plan in time"
                return Missed(version, why)
            plan = json.loads(raw)
            if self.member_id not in plan["candidates"]:
                return Missed(version, "not a member of this version's group")
            why = self._misfit(plan, checksums)
            store.set(f"{key}/ready/{self.member_id}", "no" if why else f"{ENGINE}{self.ranks}")
            if why:
                return Missed(version, why)
            start = json.loads(
                _poll(store, f"{key}/start", s.join_timeout_s + s.op_timeout_s) or '{"members": []}'
            )
            if self.member_id not in start["members"]:
                return Missed(version, "checked in too late: the version went out without it")
            try:
                self._join(store, key, plan, start)
                specs = [(name, dtype, shape) for name, dtype, shape, _, _ in plan["slots"]]
                calls = [
                    functools.partial(e.receive_weights, specs, start["group"], checksums, version)
                    for e in self.engines
                ]
                self._all(calls, store, key, s.op_timeout_s * max(1, len(specs)) + _GRACE_S)
            except Exception as exc:  # a failed join, broadcast, load or read-back
                self.group = None
                outcome = _poll(store, f"{key}/outcome", s.op_timeout_s + s.join_timeout_s)
                settled = self._all_settled()
                if settled:  # the engines drop the broken group (its sockets close)
                    self._leave(start["group"])
                if outcome == "retry" and settled:
                    continue
                first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
                return Missed(version, f"into the engine: {first} (outcome {outcome})")
            nbytes = int(plan["total"])
            return Delivered(version, time.monotonic() - started, nbytes, int(start["epoch"]))
        return Missed(version, "the source gave up on this version")

    def _misfit(self, plan: dict, checksums: Mapping[str, str]) -> str:
        if plan["senders"] != 1:
            return f"{plan['senders']} trainer ranks send: the engines' calls take one source"
        names = [slot[0] for slot in plan["slots"]]
        if sorted(names) != sorted(checksums):
            return "the plan's tensors are not the announced version's"
        return ""

    def _join(self, store: dist.TCPStore, key: str, plan: dict, start: dict) -> None:
        """Every copy into the epoch's group (a new one per epoch), at once."""
        if self.group == start["group"]:
            return
        old, self.group = self.group, None
        if old is not None:
            self._leave(old)
        rank, size = place(start, self.member_id, plan["senders"])
        assert self._address is not None
        host, port = self._address
        calls = []
        for e in self.engines:  # each copy's ranks after the one before
            join = e.join_weights_group
            calls.append(
                functools.partial(join, host, port, rank, size, start["group"], self._s.backend)
            )
            rank += e.weight_ranks
        self._all(calls, store, key, self._s.join_timeout_s + _GRACE_S)
        self.group = start["group"]

    def _all(
        self, calls: Sequence[Callable[[], None]], store: dist.TCPStore, key: str, seconds: float
    ) -> None:
        """The `calls` (one per copy) at once; raises the first failure, or TimeoutError past
        `seconds` or once the source ended the attempt (retry / gave up)."""
        self._running = [self._pool.submit(call) for call in calls]

        def done() -> bool:
            if store.check([f"{key}/outcome"]) and store.get(f"{key}/outcome") != b"delivered":
                raise TimeoutError("the source ended this attempt")
            return all(f.done() for f in self._running)

        if not _until(done, seconds):
            raise TimeoutError(f"an engine call still running after {seconds:.0f} s")
        for future in self._running:
            future.result()

    def _all_settled(self) -> bool:
        """No engine call left running (a retry needs every copy free to join again)."""
        return _until(lambda: not self.busy(), self._s.op_timeout_s + _GRACE_S)

    def _leave(self, group: str) -> None:
        for engine in self.engines:
            try:
                engine.leave_weights_group(group)
            except Exception:  # noqa: BLE001 - a group the engine no longer has
                pass

    def close(self) -> None:
        if self.group is not None and not self.busy():
            self._leave(self.group)
        self.group, self._store, self._address = None, None, None
        self._pool.shutdown(wait=False)
