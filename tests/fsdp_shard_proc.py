"""The trainer ranks' side of tests/test_fsdp_shards.py: each spawned rank trains, stores its own
shard of every version through a real transport, and writes what it saw to `<out>/rank<K>.pt`.

Versions: v0 full, v1 and v2 deltas (one chain, `keep` 2: v0 survives only by being pinned),
then v3 published by a publisher without deltas (a full version outside any chain, `keep` 5). Each
rank records, per version, the names it was given (`export_shard`), the bytes it received to build
them (`gathered_bytes`), the event it built, and (rank 0) the whole model as `export_weights`
gives it, to compare the workers' rebuilt weights with.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import torch
import torch.distributed as dist

from bus.connection import connect
from consumers.trainer_dist import exchange
from consumers.weights import transport_for
from consumers.weights.sender import WeightsSender
from engines.delta_plan import assign_shards
from engines.fsdp_train import FSDPTrainEngine, init_group
from schemas.config import WeightsConfig
from tests.fsdp_proc import ENGINE_ARGS, WORLD, steps


def settings(transport: str, root: str, delta: bool) -> WeightsConfig:
    """With deltas `keep` 2: the chain's v0 outlives v2 only by its pins. Without: nothing is
    pruned by v3 (the follower then reads every version)."""
    return WeightsConfig.model_validate(
        {
            "transport": transport,
            "dir": root,
            "delta": delta,
            "full_every": 8,
            "keep": 2 if delta else 5,
        }
    )


def rank_main(
    rank: int,
    port: int,
    model_dir: str,
    out: str,
    vocab: int,
    url: str,
    run: str,
    bucket: str,
    transport: str,
    root: str,
) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, wait_for_workers=False)
    init_group(store, rank, WORLD, torch.device("cpu"), timeout=60)
    asyncio.run(publish_versions(rank, model_dir, out, vocab, url, run, bucket, transport, root))
    dist.destroy_process_group()


async def publish_versions(
    rank: int,
    model_dir: str,
    out: str,
    vocab: int,
    url: str,
    run: str,
    bucket: str,
    transport: str,
    root: str,
) -> None:
    engine = FSDPTrainEngine(Path(model_dir), **ENGINE_ARGS)
    recorded = steps(vocab)
    layout = assign_shards(engine.weight_sizes(), WORLD)
    nc = await connect(url, f"shard-rank{rank}")
    js = nc.jetstream()
    versions: list[dict[str, object]] = []
    seen: dict[str, object] = {"layout": layout, "versions": versions}
    chain = WeightsSender(
        transport_for(settings(transport, root, True), js, bucket, run, writer=rank),
        settings(transport, root, True),
        run,
        f"rank{rank}",
        rank=rank,
        world=WORLD,
        exchange=exchange,
    )
    plain = WeightsSender(
        transport_for(settings(transport, root, False), js, bucket, run, writer=rank),
        settings(transport, root, False),
        run,
        f"rank{rank}",
        rank=rank,
        world=WORLD,
        exchange=exchange,
    )
    for version, publisher in ((0, chain), (1, chain), (2, chain), (3, plain)):
        if version:
            engine.train_step(recorded[version - 1][rank])
        own = await asyncio.to_thread(engine.export_shard, layout)
        gathered = engine.gathered_bytes
        event = await publisher.store(version, own)
        full = engine.export_weights()  # rank 0: every tensor, what the one-rank path publishes
        versions.append(
            {
                "version": version,
                "names": list(own),
                "gathered_bytes": gathered,
                "event": event.model_dump_json(),
                "full": full,
            }
        )
        dist.barrier()  # the event is built on every rank before the next version is stored
    await nc.close()
    torch.save(seen, os.path.join(out, f"rank{rank}.pt"))
