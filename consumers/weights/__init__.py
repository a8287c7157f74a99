"""Weight transports: how a version's bytes go from the trainer to the rollout workers.

`transport.WeightTransport` is the interface (publish a version -> where it is; fetch an
event's tensors, verified); `object_store` and `filesystem` implement it, `transport_for`
picks one from the run config, and `publish_version` makes the manifest and the event.
See docs/weights.md.
"""

from consumers.weights.transport import (
    Stored,
    WeightsMissing,
    WeightsUnavailable,
    WeightTransport,
    publish_version,
    transport_for,
)

__all__ = ["Stored", "WeightTransport", "WeightsMissing", "WeightsUnavailable", "publish_version", "transport_for"]
