"""The collective weight transport (`consumers.weights.collective`) over gloo,
on a real nats-server.

- Two rollout workers that the membership lists receive a version by broadcast, bit for bit,
  and the version is also stored through the fallback (the object store).
- A worker that joined late (not listed when the broadcast was planned) gets `Missed` and
  fetches the same version, bit for bit, from the fallback copy the event names.
- A real rollout worker loads a version through the transport the event names (collective),
  under the gate, by broadcast.

- Two FSDP2 trainer ranks each broadcast only their own tensors (and store their own shard of
  the fallback copy); two workers get the version bit for bit equal to `export_weights`, a
  worker not listed gets it from the sharded copy.

The engine-level failure cases (a receiver SIGKILLed mid-broadcast, a stalled one, rejoining)
are in tests/test_collective.py, with two trainer ranks in tests/test_collective_ranks.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.topology import WEIGHTS, Topology
from consumers.weights import transport_for
from consumers.weights.collective import CollectiveTransport
from consumers.weights.sender import WeightsSender
from consumers.weights.transport import fetch_full
from engines.collective_plan import ALIGN
from engines.tiny import build_tiny_model
from engines.weights import in_dtype
from producers.tasks import VOCAB
from schemas import encode
from schemas.config import WeightsConfig
from schemas.weight_event import WeightVersionEvent
from tests import fsdp_collective_proc
from tests.fsdp_proc import WORLD
from tests.test_fsdp import free_port
from tests.test_rollout_invariants import eventually, rollout_worker
from tests.test_weight_chain import serves

SETTINGS = {
    "transport": "collective",
    "collective": {"join_timeout_s": 5, "op_timeout_s": 5, "bucket_mib": 1},
}


def version(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {
        "embed": torch.randn(300_000, generator=g),
        "w": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "step": torch.tensor(v),
    }


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype
        and torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))
        for n in a
    )


def test_two_workers_get_a_version_by_broadcast_and_a_late_one_from_the_fallback_copy(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def main() -> None:
        nc = await connect(nats_server.url, "test-weights-collective")
        js = nc.jetstream()
        await topology.apply(js)
        config = WeightsConfig.model_validate(SETTINGS)

        async def listed() -> list[str]:
            return ["worker-a", "worker-b"]

        trainer = transport_for(config, js, topology.object_bucket, topology.run, members=listed)
        # A bf16 run: the float32 masters are published, and broadcast, as bfloat16.
        publisher = WeightsSender(trainer, config, topology.run, "test", dtype=torch.bfloat16)
        workers = [
            transport_for(
                config, js, topology.object_bucket, topology.run, "collective", member_id=m
            )
            for m in ("worker-a", "worker-b", "worker-late")
        ]
        try:
            masters = version(1)
            tensors = in_dtype(masters, torch.bfloat16)
            event = await publisher.store(1, masters)
            assert {s.name: s.dtype for s in event.manifest}["embed"] == "bfloat16"
            assert (event.transport, event.fallback_transport) == ("collective", "object_store")
            assert event.location == trainer.address  # type: ignore[attr-defined]
            # The workers wait for the plan (announced), then the broadcast starts.
            fetching = [asyncio.create_task(w.fetch(event)) for w in workers[:2]]
            await publisher.announced(1, masters)
            got = await asyncio.gather(*fetching)
            published = await trainer.settle()  # type: ignore[attr-defined]
            assert published is not None and published.members == ("worker-a", "worker-b"), (
                published
            )
            assert all(same_bits(g, tensors) for g in got), (
                "a broadcast version differs from the trainer's"
            )

            late = workers[2]
            assert isinstance(late, CollectiveTransport)
            missed: list[str] = []
            original = late.catch_up

            async def recorded(e, reason):
                missed.append(reason)
                return await original(e, reason)

            late.catch_up = recorded  # type: ignore[method-assign]
            assert same_bits(await late.fetch(event), tensors), (
                "the fallback copy differs from the trainer's"
            )
            assert len(missed) == 1 and "not a member" in missed[0], missed
        finally:
            for t in (trainer, *workers):
                await t.close()  # type: ignore[attr-defined]
            await topology.delete(js)
            await nc.close()

    asyncio.run(main())


def test_a_rollout_worker_loads_a_broadcast_version(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    async def main() -> None:
        async with rollout_worker(nats_server.url, topology, model_dir, weights=SETTINGS) as w:
            config = WeightsConfig.model_validate(SETTINGS)

            async def listed() -> list[str]:
                return [w.rt.source]

            trainer = transport_for(
                config, w.js, topology.object_bucket, topology.run, members=listed
            )
            publisher = WeightsSender(trainer, config, topology.run, "test")
            try:
                tensors = {
                    n: p.detach().clone() + 1e-3 for n, p in w.engine.model.named_parameters()
                }
                event = await publisher.store(1, tensors)
                await w.js.publish(topology.subject(WEIGHTS), encode(event))
                await publisher.announced(1, tensors)
                published = await trainer.settle()  # type: ignore[attr-defined]
                assert published is not None and published.members == (w.rt.source,), published
                await eventually(lambda: w.engine.version == 1, "v1 was loaded")
                assert serves(w.engine.model, tensors)
            finally:
                await publisher.close()

    asyncio.run(main())


@pytest.mark.timeout(300)
def test_two_fsdp_ranks_broadcast_their_own_shards_to_two_workers(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    """Two FSDP2 trainer ranks (gloo) each store their shard of v1 as the fallback copy and
    broadcast only their own tensors; two listed workers get v1 by broadcast, bit for bit equal
    to `export_weights`, and a worker not listed gets the same from the sharded fallback copy."""
    model = build_tiny_model(tmp_path / "model", VOCAB, seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    out = tmp_path / "out"
    out.mkdir()

    async def apply() -> None:
        nc = await connect(nats_server.url, "collective-topology")
        await topology.apply(nc.jetstream())
        await nc.close()

    asyncio.run(apply())
    ranks = mp.spawn(
        fsdp_collective_proc.rank_main,
        args=(
            free_port(),
            str(model),
            str(out),
            vocab,
            nats_server.url,
            topology.run,
            topology.object_bucket,
        ),
        nprocs=WORLD,
        join=False,
    )

    async def receive() -> list[dict[str, torch.Tensor]]:
        deadline = time.monotonic() + 180
        while not (out / "event.json").exists():
            assert time.monotonic() < deadline and all(p.is_alive() for p in ranks.processes), (
                "no event from rank 0"
            )
            await asyncio.sleep(0.2)
        event = WeightVersionEvent.model_validate_json((out / "event.json").read_text())
        assert event.transport == "collective" and len(event.shards) == WORLD, event
        assert event.fallback_location == event.shards[0].location
        nc = await connect(nats_server.url, "collective-workers")
        config = WeightsConfig.model_validate(fsdp_collective_proc.SETTINGS)
        workers = [
            transport_for(config, nc.jetstream(), topology.object_bucket, topology.run, member_id=m)
            for m in (*fsdp_collective_proc.MEMBERS, "worker-late")
        ]
        try:
            # As a rollout worker fetches a full version (`receiver.Copy.fetch`): `fetch_full`.
            got = await asyncio.gather(*(fetch_full(w, event) for w in workers[:2]))
            return [
                *got,
                await fetch_full(workers[2], event),
            ]  # not listed: Missed, then the sharded copy
        finally:
            for w in workers:
                await w.close()  # type: ignore[attr-defined]
            await nc.close()

    try:
        got = asyncio.run(receive())
        ranks.join(timeout=120)
    finally:
        for p in ranks.processes:  # a failed test leaves no rank behind
            p.kill()
    seen = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    full = seen[0]["full"]
    for r, tensors in enumerate(got):
        assert same_bits(tensors, full), f"worker {r}: v1 differs from export_weights"
    total = sum(-(-t.nbytes // ALIGN) * ALIGN for t in full.values())
    for r in range(WORLD):
        published = seen[r]["published"]
        assert published is not None and published.members == tuple(fsdp_collective_proc.MEMBERS), (
            published
        )
        own = sum(-(-full[n].nbytes // ALIGN) * ALIGN for n in seen[r]["names"])
        assert published.sent == own, (
            f"rank {r} sent {published.sent} bytes, its own tensors are {own}"
        )
        assert 0 < published.sent < 0.75 * total, f"rank {r} sent {published.sent} of {total} bytes"
    assert set(seen[0]["names"]).isdisjoint(seen[1]["names"])
