"""Weight versions from the trainer to the rollout workers: one sender, one receiver.

    trainer  tensors -> `sender.WeightsSender`: full or delta, stored through a transport,
             announced as a `WeightVersionEvent` on `weights` (rank 0), broadcast (collective)
    worker   `receiver.WeightsReceiver`: follows `weights`, resolves delta chains, verifies,
             refuses -> each version ready to load -> the rollout stage: pause, load, resume

`transport.WeightTransport` is how the bytes move (`object_store`, `filesystem`, `collective`;
`factory.transport_for` builds the one a config or an event names). The pure parts (manifest,
checksums, delta math) are in `engines/`. See docs/weights.md.
"""

from consumers.weights.factory import transport_for
from consumers.weights.receiver import Ready, WeightsReceiver
from consumers.weights.sender import WeightsSender, publish_version
from consumers.weights.transport import (
    Stored,
    WeightsMissing,
    WeightsUnavailable,
    WeightTransport,
)

__all__ = [
    "Ready",
    "Stored",
    "WeightTransport",
    "WeightsMissing",
    "WeightsReceiver",
    "WeightsSender",
    "WeightsUnavailable",
    "publish_version",
    "transport_for",
]
