"""Old weight versions leave the store as soon as no worker needs them (`engines.weight_retention`,
`WeightsSender.retire`).

- The pure rule: the latest version's delta chain is kept whole; a live worker lagging within
  the staleness bound keeps the version it loads next, with that version's chain; one further
  behind, one not reported yet and one current keep nothing more; without deltas a version
  is its own chain; what to delete spares versions above the latest.
- On a real nats-server, object store, real rollout workers (tiny HF engine), the sender
  announcing through the bus and reading the members bucket: after each version the store
  holds only what the rule keeps (a lagging worker's heartbeat keeps its next chain until it
  leaves), with `keep` set far higher; a worker that joins after several versions still loads
  the latest, bit for bit, from the chain's full version and its deltas.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

from bus.embedded import EmbeddedNats
from bus.membership import live_members
from bus.objects import list_objects
from bus.publisher import Publisher
from bus.topology import Topology
from consumers.weights import WeightsSender, transport_for
from consumers.weights.object_store import VERSION_OBJECT
from engines.weight_retention import Published, needed, stale_payloads
from schemas.config import WeightsConfig
from schemas.kv_records import Member
from tests.helpers import dead_letters
from tests.test_rollout_invariants import dead_stored, eventually, rollout_worker
from tests.test_weight_chain import serves, step


def chains(*spans: tuple[int, int]) -> list[Published]:
    """Versions `first..last` of each span, as one delta chain from `first`."""
    return [
        Published(v, first, (f"v{v}",)) for first, last in spans for v in range(first, last + 1)
    ]


def versions(kept: list[Published]) -> list[int]:
    return [p.version for p in kept]


def test_the_latest_chain_is_kept_whole_and_lagging_workers_keep_their_next_chain() -> None:
    published = chains((0, 2), (3, 5), (6, 7))
    assert versions(needed(published, [], 1)) == [6, 7]
    assert versions(needed(published, [None, 7, 9], 1)) == [6, 7]  # unreported, current, ahead
    assert versions(needed(published, [6], 1)) == [6, 7]
    # Serving v4: v5 comes next, on the chain from v3; within the bound 2 (7 - 5).
    assert versions(needed(published, [4], 2)) == [3, 4, 5, 6, 7]
    assert versions(needed(published, [4], 1)) == [6, 7]  # beyond it: skips to v7
    assert versions(needed(published, [2], 4)) == [3, 6, 7]  # v3: a full version, alone
    # What is stored, not what was once published: the next version still there.
    assert versions(needed([p for p in published if p.version > 4], [1], 3)) == [5, 6, 7]
    whole = [Published(v, None, (f"v{v}",)) for v in range(5)]
    assert versions(needed(whole, [], 0)) == [4]
    assert versions(needed(whole, [2], 1)) == [3, 4]
    assert needed([], [1], 1) == []


def test_stale_payloads_spare_kept_locations_and_versions_above_the_latest() -> None:
    stored = [("v3-a", 3), ("v3-b", 3), ("v4-a", 4), ("v5-a", 5), ("v6-x", 6)]
    assert stale_payloads(stored, {"v4-a", "v5-a"}, 5) == ["v3-a", "v3-b"]
    assert stale_payloads(stored, {"v5-a"}, 5) == ["v3-a", "v3-b", "v4-a"]


def test_the_store_keeps_only_what_workers_need_and_a_late_worker_catches_up(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    async def main() -> None:
        settings = {"delta": True, "full_every": 3, "keep": 50}
        async with rollout_worker(nats_server.url, topology, model_dir, weights=settings) as w:
            config = WeightsConfig.model_validate(settings)
            members = await w.js.key_value(topology.members_bucket)

            async def served() -> list[int | None]:
                live = await live_members(w.js, topology)
                return [m.weight_version for m in live if m.role == "rollout"]

            sender = WeightsSender(
                transport_for(config, w.js, topology.object_bucket, topology.run),
                config,
                topology.run,
                "test",
                publisher=Publisher(w.js, topology),
                served=served,
                max_staleness=2,
            )

            async def stored() -> list[int]:
                names = [i.name for i in await list_objects(w.js, topology.object_bucket)]
                found = [VERSION_OBJECT.fullmatch(name) for name in names]
                return sorted(int(m.group(1)) for m in found if m)

            async def lagging(version: int) -> None:
                """Another rollout worker's heartbeat: it serves `version`."""
                now = time.time()
                member = Member(
                    role="rollout",
                    node=socket.gethostname(),
                    pid=os.getpid() + 1,
                    started_at=now,
                    updated_at=now,
                    weight_version=version,
                )
                await members.put("lagging", member.encode())

            weights = {0: {n: p.detach().clone() for n, p in w.engine.model.named_parameters()}}
            kept = {}  # chains: v0-v2, v3-v5, v6-v8
            for version in range(9):
                if version:
                    weights[version] = step(weights[version - 1], version)
                if version < 8:
                    await lagging(4)  # its heartbeat (the entry's TTL is 15 s)
                else:
                    await members.delete("lagging")  # it left: nobody needs v3-v5
                await sender.send(version, weights[version])
                await sender.retired()  # deleting runs behind the trainer's next step
                kept[version] = await stored()
                await eventually(
                    lambda v=version: w.engine.version == v or dead_stored(w, 1),  # type: ignore[misc]  # the default binds the loop value
                    f"v{version} was handled",
                )
                assert w.engine.version == version, await dead_letters(w.js, topology)
            assert kept == {
                0: [0],
                1: [0, 1],
                2: [0, 1, 2],
                3: [3],  # the lagging worker (v4) needs nothing before v5
                4: [3, 4],
                5: [3, 4, 5],
                6: [3, 4, 5, 6],  # its next version, v5, within the bound: v5's chain stays
                7: [3, 4, 5, 6, 7],
                8: [6, 7, 8],
            }, kept

            async with rollout_worker(
                nats_server.url, topology, model_dir, weights=settings
            ) as late:
                await eventually(
                    lambda: late.engine.version == 8 or dead_stored(w, 1),
                    "the late worker handled v8",
                )
                assert late.engine.version == 8, (
                    f"the late worker did not load v8: {await dead_letters(w.js, topology)}"
                )
                assert serves(late.engine.model, weights[8]), "the late worker's v8 differs"

    asyncio.run(main())
