"""`transport_for`: the weight transport a run config (or an event) names, built.

Its own module so that the concrete transports (`object_store`, `filesystem`, `collective`)
import only the interface (`consumers.weights.transport`) and nothing imports them back:

    factory -> object_store | filesystem | collective -> transport
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from bus.connection import JetStream
from consumers.weights.collective import CollectiveTransport
from consumers.weights.filesystem import FilesystemTransport
from consumers.weights.object_store import ObjectStoreTransport
from consumers.weights.transport import WeightTransport
from engines.weights import WeightsRefused
from schemas.config import WeightsConfig
from schemas.weight_event import TransportName


def transport_for(
    config: WeightsConfig,
    js: JetStream,
    bucket: str,
    run: str,
    name: TransportName | None = None,
    *,
    members: Callable[[], Awaitable[list[str]]] | None = None,
    member_id: str = "",
    writer: int = 0,
) -> WeightTransport:
    """The transport `name` (default: the configured one) of run `run`, object store `bucket`.

    A reader builds the one its event names: the config says what the trainer publishes with.
    collective: `members` (the trainer's: the live rollout workers' ids) or `member_id` (a
    worker's own id); its fallback copies go through the transport the event names.
    `writer`: the trainer rank that publishes through it (filesystem: its temporary files' tag;
    collective: the rank that hosts the broadcast (0) or joins it).
    """
    name = name or config.transport
    if name == "collective":
        stores: dict[TransportName, WeightTransport] = {}

        def fallback(store: TransportName) -> WeightTransport:
            if store not in stores:
                stores[store] = transport_for(config, js, bucket, run, store, writer=writer)
            return stores[store]

        return CollectiveTransport(config, fallback, members, member_id, writer)
    if name == "object_store":
        return ObjectStoreTransport(
            js, bucket, config.chunk_bytes, config.keep, config.stall_seconds
        )
    if name == "filesystem":
        if not Path(config.dir).is_absolute():
            raise WeightsRefused(
                f"weights.dir {config.dir!r} is not an absolute path "
                "(the producer fills it in; set it in the run config)"
            )
        return FilesystemTransport(Path(config.dir) / run, config.keep, writer)
    raise WeightsRefused(f"unknown weights transport {name}")
