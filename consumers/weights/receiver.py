"""A rollout worker's side of weight versions: `WeightsReceiver` yields each version ready to load.

    weights stream, from the last stored event on (`bus.readers.Broadcast`, which decodes:
    bytes that are no event are its poison, dead-lettered)
      -> skip a version served already (the same number from another event is a resumed
         trainer's: loaded again; a lower one is not, newer ones follow)
      -> `check_manifest`: the manifest names the model's parameters, with their shapes,
         before a byte is fetched
      -> `Copy.fetch`: outside a delta chain, the version fetched whole; on a chain, the CPU
         copy brought to it: the chain's full version and/or each delta (`plan_fetch`; the
         events of the chain's earlier versions looked up backwards on the stream,
         `earlier`, with `bus.readers.LastStored`), a delta applied only onto the base
         version it names, in a thread, all or nothing, every tensor checked against the
         manifest
      -> yield `Ready` (event + verified tensors + `changed`, the names whose bytes differ
         from what the engine holds): the stage pauses, loads those, resumes, and says so
         (`loaded`); only then does the receiver count the version as served

What the engine holds is known by checksum: the manifest of the version last confirmed
loaded (`held`, name -> sha256). A version's `changed` tensors are those whose sha256 differs
from it, whether the version came whole or as a delta: a delta's untouched tensors, or the
frozen tensors of a full version, never reach the engine again. Nothing is known of the
weights the engine started with, and nothing after a load that was not confirmed (a bucket
may have gone in): `held` is then empty and the next version goes in whole.

What fails is handled here, one way each: bytes that must never be loaded (a bad manifest or
checksum, a delta onto a base the copy does not hold) are refused through the reader
(`refuse`: logged and dead-lettered with the reason, as its poison is); the worker keeps
what it serves. Bytes gone (pruned) because a
newer version is announced: the version is skipped (logged). Bytes that cannot be read now:
logged, the next version is taken. Generation goes on through all of it: only the stage's
load is under its gate.

The copy holds the tensors in the published dtype, so that deltas apply bit for bit. A delta
that fails its checksum drops the copy: the next version is pulled from the chain's full
version (a trainer resumed from a checkpoint may have published other bytes under the
versions the copy went through). A delta whose base the copy does not hold is refused before
it is applied, and the copy is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import torch

from bus.connection import JetStream
from bus.publisher import Publisher
from bus.readers import Broadcast, LastStored, Poison, Stored
from bus.topology import WEIGHTS, Topology
from consumers.weights.collective import CollectiveTransport
from consumers.weights.factory import transport_for
from consumers.weights.transport import (
    WeightsMissing,
    WeightsUnavailable,
    WeightTransport,
    fetch_full,
)
from engines.delta_plan import plan_fetch
from engines.weight_delta import apply_delta
from engines.weights import WeightsRefused, check_manifest
from engines.weights_group import GroupWeights
from schemas import WeightVersionEvent
from schemas.config import WeightsConfig

log = logging.getLogger("jetrl.weights.receiver")

ROLE = "rollout"
"""Who reads `weights` through a receiver: its dead letters are `dead.rollout`'s."""

Earlier = Callable[[set[int], int], Awaitable[dict[int, WeightVersionEvent]]]
"""(versions, full version) -> the events of those versions on the chain starting at that
full version, published before the event being followed; WeightsMissing for any not found."""


@dataclass(frozen=True)
class Ready:
    """A version verified and ready to load: its event and its tensors (CPU, the manifest's
    names; the copy's own on a delta chain, to be loaded before the receiver goes on), and
    `changed`: the names of those whose bytes differ from what the engine holds, the only
    ones the stage hands it."""

    event: WeightVersionEvent
    tensors: dict[str, torch.Tensor]
    changed: frozenset[str]
    direct: bool = False
    """True: the version goes by broadcast into the engines themselves (`into_engines`, under
    the stage's gate); `tensors` is empty until then."""

    def to_load(self) -> dict[str, torch.Tensor]:
        """The tensors the engine does not hold yet (`changed`), by name."""
        return {name: tensor for name, tensor in self.tensors.items() if name in self.changed}


class Copy:
    """A worker's CPU copy of the chain version it serves, brought to each new version."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        """The version `tensors` holds; None: no copy (none yet, or dropped after a failed
        delta)."""
        self.event_id: str | None = None
        """Id of the event of the version held: a resumed trainer's event of that version
        (another id) announces other bytes."""

    async def fetch(
        self,
        event: WeightVersionEvent,
        transport_of: Callable[[WeightVersionEvent], WeightTransport],
        earlier: Earlier,
    ) -> dict[str, torch.Tensor]:
        """`event`'s tensors. Outside a chain: fetched as a full version, no copy kept. On a
        chain: the copy, brought to `event.version` (full version and deltas as `plan_fetch`
        says); its tensors are the copy's, to be loaded before the next `fetch`."""
        if event.full_version is None:
            return await fetch_full(transport_of(event), event)
        if self.version == event.version and self.event_id != event.id:
            self.tensors, self.version = (
                {},
                None,
            )  # the copy is another chain's version of that number
        if event.base_version is None:
            await self._full(event, transport_of(event))
            return self.tensors
        plan = plan_fetch(
            event.version, event.full_version, self.version, event.version - event.base_version
        )
        needed = {step.version for step in plan} - {event.version}
        events = {
            event.version: event,
            **(await earlier(needed, event.full_version) if needed else {}),
        }
        if set(events) < {step.version for step in plan}:
            missing = sorted(needed - set(events))
            raise WeightsMissing(
                f"v{event.version}: the events of its chain's versions {missing} are gone"
            )
        for step in plan:
            step_event = events[step.version]
            if step.base is None:
                await self._full(step_event, transport_of(step_event))
            else:
                await self._delta(step_event, transport_of(step_event))
        return self.tensors

    async def _full(self, event: WeightVersionEvent, transport: WeightTransport) -> None:
        tensors = await fetch_full(transport, event)
        if transport.name == "filesystem":
            # Views of a read-only file mapping: deltas are applied onto a copy of our own.
            tensors = await asyncio.to_thread(
                lambda: {name: t.clone() for name, t in tensors.items()}
            )
        self.tensors, self.version, self.event_id = tensors, event.version, event.id

    async def _delta(self, event: WeightVersionEvent, transport: WeightTransport) -> None:
        assert event.base_version is not None
        # The base check: applied onto another version, the delta would fail its checksum
        # only after changing the copy, and the copy would be dropped with it.
        if self.version != event.base_version:
            raise WeightsRefused(
                f"v{event.version} applies onto v{event.base_version}, "
                f"the copy holds v{self.version}"
            )
        payloads = [await transport.fetch_bytes(shard) for shard in event.shards]
        try:
            await asyncio.to_thread(
                apply_delta,
                self.tensors,
                payloads,
                event.manifest,
                version=event.version,
                base_version=event.base_version,
            )
        except WeightsRefused:
            # All or nothing: the copy is still the base, but it may not be this chain's base.
            self.tensors, self.version = {}, None
            raise
        self.version, self.event_id = event.version, event.id


class WeightsReceiver:
    """Follows the run's `weights` stream for one rollout worker and yields each version it
    should load, verified (`async for ready in receiver`).

    `model`: the worker's model (a manifest must name its parameters); `version`: the version
    it serves at the start; `handled`: set after each event, whatever came of it (the rollout's
    gate: a worker starts generating once it has handled the last version announced)."""

    def __init__(
        self,
        js: JetStream,
        topology: Topology,
        publisher: Publisher,
        config: WeightsConfig,
        model: torch.nn.Module,
        *,
        member_id: str = "",
        version: int = 0,
        handled: asyncio.Event | None = None,
    ) -> None:
        self.js, self.topology, self.publisher, self.config = js, topology, publisher, config
        self.model, self.member_id, self.handled = model, member_id, handled
        self.version = version
        """The version served: the last one the stage confirmed loaded (`loaded`)."""
        self.served: str | None = None
        """Id of the event served; None: the weights the worker started with."""
        self.held: dict[str, str] = {}
        """Name -> sha256 of the tensors the engine holds (the manifest of the version served);
        empty when unknown: at the start, and after a load that was not confirmed."""
        self.chain = Copy()
        """The CPU copy of the version served, which deltas apply onto (`weights.delta`)."""
        self.transports: dict[str, WeightTransport] = {}
        """By name, made when an event first names one: the event says where its bytes are."""
        self.engines: list[GroupWeights] = []
        """The rollout's engine copies when every one takes a broadcast into its own memory
        (`GroupWeights`): then a collective version is yielded `direct`, not received here."""
        self.lookup = LastStored(js, topology, WEIGHTS, Poison(ROLE))
        """Single events of `weights` (the last, the chain's earlier ones); poison only logged:
        the follower dead-letters it."""
        self.following = False
        """True once `follow` reads the stream (a trainer's lent rollout loads its own)."""
        self.handled_version = -1
        """The newest version announced and handled: served, refused or skipped."""
        self.progress = asyncio.Event()
        """Set (and replaced) each time a version is handled: what `caught_up` waits on."""

    def __aiter__(self) -> AsyncIterator[Ready]:
        return self.follow()

    async def follow(self) -> AsyncGenerator[Ready]:
        """Each version to load, in the order announced; the stage loads it before asking again.
        `weights` is read from its last stored event on (bytes that are no event: dead-lettered
        by the reader, as every refused version is)."""
        reader = Broadcast(self.js, self.topology, WEIGHTS, Poison(ROLE, self.publisher))
        self.following = True
        async with reader:
            async for stored in reader:
                ready = await self.receive(stored, reader)
                if ready is not None:
                    yield ready
                    if self.served != ready.event.id:
                        # Not confirmed: some of its tensors may be in the engine, some not.
                        self.held = {}
                        log.warning(
                            "weights v%d not confirmed loaded, still serving v%d; the next "
                            "version goes in whole",
                            ready.event.version,
                            self.version,
                        )
                if self.handled is not None:
                    self.handled.set()
                self.handled_version = max(self.handled_version, stored.event.version)
                self.progress.set()
                self.progress = asyncio.Event()

    async def caught_up(self, version: int, timeout: float) -> bool:
        """Wait until `version` is served, or handled and not served (refused, skipped; then the
        version served is the newest there is to serve), for at most `timeout` s; whether it
        came. At once when `follow` is not reading (nothing here would load it)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.following and self.version < version and self.handled_version < version:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.progress.wait(), left)
        return True

    def loaded(self, ready: Ready) -> None:
        """The stage's word that every engine copy holds `ready`'s version (each load read
        back): the version is served, and the next version's `changed` is counted from it."""
        self.version, self.served = ready.event.version, ready.event.id
        self.held = {spec.name: spec.sha256 for spec in ready.event.manifest}

    async def receive(
        self, stored: Stored[WeightVersionEvent], reader: Broadcast[WeightVersionEvent]
    ) -> Ready | None:
        """`stored`'s version, verified; None for one not to load (served already, refused,
        skipped)."""
        event = stored.event
        try:
            return await self.fetch(event, stored.seq)
        except WeightsMissing as exc:  # pruned: gone only once newer versions were stored
            newer = await self.superseded(event)
            if newer is None:
                log.warning("weights not loaded, still serving v%d: %s", self.version, exc)
            elif newer:
                log.info(
                    "weights v%d skipped, a newer version is announced: %s", event.version, exc
                )
            else:
                await reader.refuse(stored, f"weights refused: {exc}")
        except WeightsRefused as exc:  # never loaded; the worker keeps serving what it has
            await reader.refuse(stored, f"weights refused: {exc}")
        except (nats.errors.Error, WeightsUnavailable) as exc:
            # Not fetched now; a later version will be.
            log.warning("weights not loaded, still serving v%d: %s", self.version, exc)
        return None

    async def fetch(self, event: WeightVersionEvent, seq: int) -> Ready | None:
        """`event`'s tensors if they are to be served; WeightsRefused if they do not fit the model.

        A trainer resumed from a checkpoint publishes versions again, with other bytes: the
        version served is loaded again from such an event (another id), one below it is not
        (a newer one follows). `seq`: the event's stream sequence, from which the events of
        its chain are looked up."""
        if event.version < self.version or (
            event.version == self.version and self.served in (None, event.id)
        ):
            # A version served already; the same number from another event is a resumed trainer's.
            return None
        check_manifest(event.manifest, self.model)  # before a byte is fetched
        # Into the engines themselves: one sender only (several trainer ranks announce shards).
        direct = event.transport == "collective" and not event.shards
        if self.engines and direct and event.full_version is None:
            return Ready(event, {}, frozenset(s.name for s in event.manifest), direct=True)
        tensors = await self.chain.fetch(
            event, self.transport, lambda versions, full: self.earlier(seq, versions, full)
        )
        changed = frozenset(s.name for s in event.manifest if self.held.get(s.name) != s.sha256)
        return Ready(event, tensors, changed)

    async def into_engines(self, ready: Ready) -> dict[str, torch.Tensor] | None:
        """Under the stage's gate, a `direct` version broadcast into `engines`: None once every
        copy holds it (each load read back), else the stored fallback copy's tensors, verified,
        to load whole (`WeightsRefused` / `WeightsUnavailable` when that copy cannot be had:
        the engines may hold a mix, and the stage ends the worker)."""
        transport = self.transport(ready.event)
        assert isinstance(transport, CollectiveTransport)
        return await transport.into_engines(ready.event, self.engines)

    async def superseded(self, event: WeightVersionEvent) -> bool | None:
        """Whether a version newer than `event`'s is announced (the last on `weights`); None
        when the server cannot say now."""
        try:
            last = await self.lookup.last()
        except nats.errors.Error:
            return None
        return last is not None and last.event.version > event.version

    async def earlier(
        self, seq: int, versions: set[int], full: int
    ) -> dict[int, WeightVersionEvent]:
        """The events of `versions` on the chain from full version `full`, looked up backwards
        on `weights` from sequence `seq` (the event being loaded): the nearest one of each
        version, since a trainer resumed from a checkpoint publishes a version again. The walk
        ends at the chain's full version (at most `full_every` versions back), or at the
        stream's first message."""
        found: dict[int, WeightVersionEvent] = {}
        async for stored in self.lookup.back(start=seq - 1):
            event = stored.event
            if (
                event.version in versions
                and event.full_version == full
                and event.version not in found
            ):
                found[event.version] = event
            if versions <= set(found) or (event.version == full and event.base_version is None):
                break
        return found

    def transport(self, event: WeightVersionEvent) -> WeightTransport:
        if event.transport not in self.transports:
            self.transports[event.transport] = transport_for(
                self.config,
                self.js,
                self.topology.object_bucket,
                self.topology.run,
                event.transport,
                member_id=self.member_id,
            )
        return self.transports[event.transport]
