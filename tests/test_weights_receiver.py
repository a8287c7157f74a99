"""The weights receiver's base check (issue 25, item 8), on a real nats-server, a real
filesystem transport and a real rollout worker (tiny HF engine).

A delta is refused before it is applied when the worker's CPU copy is not the version it
applies onto, and the copy stays as it was. Without the check the checksum would still stop
the delta, but only after applying it, and the worker would drop its copy.

How the worker comes to meet such a delta: its copy holds v2 of chain A (v0 full, v1, v2),
then it serves v5 published without deltas (no copy kept: the copy stays at A's v2). Another
chain B from a full v0 (other bytes) announces v3 (a delta on v1: B skipped v2), v4 and v5.
v3 and v4 are below the version served: skipped. B's v5 is that version from another event:
handled, planned from the copy's v2 as v3, v4, v5, and B's v3 applies onto v1, not v2.
"""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import torch

from bus.embedded import EmbeddedNats
from bus.topology import WEIGHTS, Topology
from consumers.weights import WeightsSender, transport_for
from schemas import WeightVersionEvent, encode
from schemas.config import WeightsConfig
from tests.helpers import dead_letters
from tests.test_rollout_invariants import dead_stored, eventually, rollout_worker
from tests.test_weight_chain import serves, step


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a
    )


def test_a_delta_onto_a_base_the_copy_does_not_hold_is_refused_before_it_is_applied(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path, tmp_path: Path
) -> None:
    async def main() -> None:
        settings = {
            "transport": "filesystem",
            "dir": str(tmp_path),
            "delta": True,
            "full_every": 8,
            "keep": 20,
        }
        async with rollout_worker(nats_server.url, topology, model_dir, weights=settings) as w:
            config = WeightsConfig.model_validate(settings)
            whole = config.model_copy(update={"delta": False})

            def sender(cfg: WeightsConfig) -> WeightsSender:
                store = transport_for(cfg, w.js, topology.object_bucket, topology.run)
                return WeightsSender(store, cfg, topology.run, "test")

            async def announce(event: WeightVersionEvent) -> None:
                await w.js.publish(topology.subject(WEIGHTS), encode(event))

            def serving(version: int) -> bool:
                return w.engine.version == version

            a, b, plain = sender(config), sender(config), sender(whole)
            chain_a = {0: {n: p.detach().clone() for n, p in w.engine.model.named_parameters()}}
            for version in (0, 1, 2):
                if version:
                    chain_a[version] = step(chain_a[version - 1], version)
                await announce(await a.store(version, chain_a[version]))
                await eventually(partial(serving, version), f"A's v{version} was loaded")
            receiver = w.rollout.receiver
            assert receiver.chain.version == 2 and same_bits(receiver.chain.tensors, chain_a[2])

            outside = step(chain_a[2], 5)
            await announce(await plain.store(5, outside))
            await eventually(lambda: w.engine.version == 5, "v5 (no chain) was loaded")
            assert receiver.chain.version == 2, "a version outside the chain changed the copy"

            chain_b = {0: {n: t + 1e-2 for n, t in chain_a[0].items()}}
            for version in (1, 3, 4, 5):
                chain_b[version] = step(
                    chain_b[max(v for v in chain_b if v < version)], 10 + version
                )
            events = {
                version: await b.store(version, tensors) for version, tensors in chain_b.items()
            }
            assert (events[3].base_version, events[3].full_version) == (1, 0)
            for version in (3, 4, 5):  # B's v0 and v1 are stored, never announced
                await announce(events[version])
            await eventually(lambda: dead_stored(w, 1), "B's v5 was refused")

            assert receiver.chain.version == 2, (
                f"the copy was dropped or changed: at v{receiver.chain.version}"
            )
            assert same_bits(receiver.chain.tensors, chain_a[2]), "the copy's tensors changed"
            reasons = [reason for _, reason in await dead_letters(w.js, topology)]
            assert len(reasons) == 1 and "applies onto v1, the copy holds v2" in reasons[0], reasons
            assert w.engine.version == 5 and serves(w.engine.model, outside), (
                "the served weights changed"
            )

    asyncio.run(main())
