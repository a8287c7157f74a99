"""The trainer ranks' side of tests/test_weights_collective.py's two-rank test: each spawned
FSDP2 rank trains one step, stores its own shard of v1 as the fallback copy and broadcasts its
own tensors (`weights.transport: collective`, `WeightsSender` over the ranks' exchange).

Rank 0 writes the event to `<out>/event.json` once it is built (the test's receivers start
from it, as workers start from the `weights` stream); every rank then broadcasts, waits for
its broadcast's outcome, and writes `<out>/rank<K>.pt`: the names it was given, what it sent
(`Published`), and (rank 0) the whole model as `export_weights` gathers it.
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
from consumers.weights.collective import CollectiveTransport
from consumers.weights.sender import WeightsSender
from engines.delta_plan import assign_shards
from engines.fsdp_train import FSDPTrainEngine, init_group
from schemas.config import WeightsConfig
from tests.fsdp_proc import ENGINE_ARGS, WORLD, steps

MEMBERS = ["worker-a", "worker-b"]
SETTINGS = {
    "transport": "collective",
    "collective": {"join_timeout_s": 30, "op_timeout_s": 10, "bucket_mib": 1},
}


def rank_main(
    rank: int, port: int, model_dir: str, out: str, vocab: int, url: str, run: str, bucket: str
) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, wait_for_workers=False)
    init_group(store, rank, WORLD, torch.device("cpu"), timeout=120)
    asyncio.run(publish(rank, model_dir, out, vocab, url, run, bucket))
    dist.destroy_process_group()


async def publish(
    rank: int, model_dir: str, out: str, vocab: int, url: str, run: str, bucket: str
) -> None:
    engine = FSDPTrainEngine(Path(model_dir), **ENGINE_ARGS)
    engine.train_step(steps(vocab)[0][rank])
    layout = assign_shards(engine.weight_sizes(), WORLD)
    own = await asyncio.to_thread(engine.export_shard, layout)
    nc = await connect(url, f"collective-rank{rank}")
    config = WeightsConfig.model_validate(SETTINGS)

    async def members() -> list[str]:
        return list(MEMBERS)

    transport = transport_for(config, nc.jetstream(), bucket, run, members=members, writer=rank)
    assert isinstance(transport, CollectiveTransport)
    publisher = WeightsSender(
        transport, config, run, f"rank{rank}", rank=rank, world=WORLD, exchange=exchange
    )
    event = await publisher.store(1, own)
    if rank == 0:
        tmp = os.path.join(out, "event.json.tmp")
        Path(tmp).write_text(event.model_dump_json())
        os.replace(tmp, os.path.join(out, "event.json"))
    await publisher.announced(1, own)
    published = await transport.settle()
    await publisher.close()
    await nc.close()
    full = engine.export_weights()  # every rank takes part; rank 0 gets the whole model
    seen = {
        "names": list(own),
        "published": published,
        "full": full,
        "event": event.model_dump_json(),
    }
    torch.save(seen, os.path.join(out, f"rank{rank}.pt"))
