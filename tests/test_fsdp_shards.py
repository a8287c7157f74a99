"""Sharded weight versions: two FSDP2 ranks (gloo, CPU) each store only their own shard of every
version through a real transport (real nats-server), and a worker's `receiver.Copy` rebuilds the
weights bit for bit equal to what `export_weights` gathers to rank 0.

- Each rank gathers only the tensors `assign_shards` gives it: the bytes it receives are its
  own tensors' rows (padded to equal pieces), not the model's.
- Each rank's stored payload holds exactly its names (a full version's safetensors file, a
  delta's `jetrl-delta/1` shard written by that rank).
- A follower rebuilds v0 (full, sharded), then v1 and v2 (deltas); a late follower pulls v0's
  shards and both deltas at once (v0 kept by the chain's pins though `keep` is 2, whichever
  rank pruned last); a full version outside a chain (no deltas) is sharded and fetched too.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.topology import Topology
from consumers.weights import transport_for
from consumers.weights.receiver import Copy
from consumers.weights.transport import WeightsMissing
from engines.tiny import build_tiny_model
from engines.weight_delta import read_shard
from producers.tasks import VOCAB
from schemas.weight_event import WeightVersionEvent
from tests import fsdp_shard_proc
from tests.fsdp_proc import WORLD
from tests.test_fsdp import free_port


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[n].dtype == b[n].dtype
        and a[n].shape == b[n].shape
        and torch.equal(a[n].contiguous().view(torch.uint8), b[n].contiguous().view(torch.uint8))
        for n in a
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["object_store", "filesystem"])
def test_each_rank_stores_its_own_shard_and_a_follower_rebuilds_the_weights_bit_for_bit(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path, transport: str
) -> None:
    model = build_tiny_model(tmp_path / "model", VOCAB, seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    root = str(tmp_path / "weights")
    out = tmp_path / "out"
    out.mkdir()

    async def apply() -> None:
        nc = await connect(nats_server.url, "shard-topology")
        await topology.apply(nc.jetstream())
        await nc.close()

    asyncio.run(apply())
    mp.spawn(
        fsdp_shard_proc.rank_main,
        args=(
            free_port(),
            str(model),
            str(out),
            vocab,
            nats_server.url,
            topology.run,
            topology.object_bucket,
            transport,
            root,
        ),
        nprocs=WORLD,
        join=True,
    )
    seen = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    layout = seen[0]["layout"]
    assert all(layout[r] for r in range(WORLD)), f"a rank owns nothing: {layout}"
    full = [v["full"] for v in seen[0]["versions"]]
    params = full[0]
    total = sum(t.nbytes for t in params.values())
    assert set(params) == {n for names in layout for n in names}
    for r in range(WORLD):
        for v in seen[r]["versions"]:
            assert v["names"] == [n for n in params if n in set(layout[r])], (
                f"rank {r} v{v['version']}: {v['names']}"
            )
            # What rank r received: its own tensors, each as WORLD pieces of ceil(rows / WORLD)
            # rows.
            owned = sum(
                WORLD * math.ceil(params[n].shape[0] / WORLD) * params[n][0].nbytes
                for n in layout[r]
            )
            assert v["gathered_bytes"] == owned, (r, v["gathered_bytes"], owned, total)
            assert v["gathered_bytes"] < 0.75 * total, (
                f"rank {r} gathered {v['gathered_bytes']} of {total} bytes"
            )
    events = [WeightVersionEvent.model_validate_json(v["event"]) for v in seen[0]["versions"]]
    same = {"location", "manifest", "total_bytes", "shards", "base_version", "full_version"}
    assert [
        WeightVersionEvent.model_validate_json(v["event"]).model_dump(include=same)
        for v in seen[1]["versions"]
    ] == [e.model_dump(include=same) for e in events], "the ranks built different events"
    assert [(e.base_version, e.full_version) for e in events] == [
        (None, 0),
        (0, 0),
        (1, 0),
        (None, None),
    ]

    async def follow() -> None:
        nc = await connect(nats_server.url, "shard-follower")
        try:
            store = transport_for(
                fsdp_shard_proc.settings(transport, root, True),
                nc.jetstream(),
                topology.object_bucket,
                topology.run,
            )
            for event in events:  # each shard holds its rank's names, nothing else
                assert [s.tensors for s in event.shards] == [tuple(names) for names in layout]
                for rank, shard in enumerate(event.shards):
                    try:
                        payload = await store.fetch_bytes(shard)
                    except WeightsMissing:  # pruned by a rank that did not pin the others' shards
                        payload = None
                    assert payload is not None, f"v{event.version}: rank {rank}'s shard was pruned"
                    if event.base_version is None:
                        assert sorted(load(payload)) == sorted(layout[rank]), (
                            f"v{event.version} shard {rank}"
                        )
                    else:
                        header, _ = read_shard(payload)
                        assert header.rank == rank and [t.name for t in header.tensors] == list(
                            shard.tensors
                        )

            async def earlier(versions: set[int], _full: int) -> dict[int, WeightVersionEvent]:
                return {e.version: e for e in events if e.version in versions}

            follower = Copy()
            for event in events[:3]:
                got = await follower.fetch(event, lambda _e: store, earlier)
                assert bits_equal(got, full[event.version]), (
                    f"v{event.version} rebuilt differs from export_weights"
                )
            late = Copy()  # its first event a delta: v0's shards, then v1 and v2
            assert bits_equal(await late.fetch(events[2], lambda _e: store, earlier), full[2])
            assert bits_equal(await Copy().fetch(events[3], lambda _e: store, earlier), full[3])
        finally:
            await topology.delete(nc.jetstream())
            await nc.close()

    asyncio.run(follow())
