"""Weight versions go out in the rollout's dtype (`model.dtype`), not as the trainer's float32
masters: a bfloat16 run stores and moves half the bytes (issue 28).

- The pure cast (`engines.weights.in_dtype`): floating tensors to the published dtype, integer
  ones untouched, a tensor already in it passed on without a copy.
- On a real nats-server and object store, a sender publishing bfloat16 announces a version
  whose manifest is bfloat16 and whose stored bytes are half those of the float32 masters it
  was handed; a real rollout worker loads it and serves exactly the masters rounded to bf16.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.topology import Topology
from consumers.weights import WeightsSender, transport_for
from engines.weights import in_dtype
from schemas.config import WeightsConfig
from schemas.weight_event import WeightVersionEvent
from tests.test_rollout_invariants import eventually, rollout_worker
from tests.test_weight_chain import serves, step


def test_floating_tensors_are_cast_and_the_others_left_alone() -> None:
    masters = {"w": torch.randn(4, 3), "ids": torch.arange(5), "b": torch.zeros(2)}
    out = in_dtype(masters, torch.bfloat16)
    assert {n: t.dtype for n, t in out.items()} == {
        "w": torch.bfloat16,
        "ids": torch.int64,
        "b": torch.bfloat16,
    }
    assert out["ids"] is masters["ids"]
    assert torch.equal(out["w"], masters["w"].to(torch.bfloat16))
    again = in_dtype(out, torch.bfloat16)
    assert all(again[n] is out[n] for n in out), "a tensor already in the dtype was copied"


def test_a_bf16_sender_stores_half_the_bytes_and_the_worker_loads_them(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    async def main() -> None:
        settings = {"delta": False}
        async with rollout_worker(nats_server.url, topology, model_dir, weights=settings) as w:
            config = WeightsConfig.model_validate(settings)
            sender = WeightsSender(
                transport_for(config, w.js, topology.object_bucket, topology.run),
                config,
                topology.run,
                "test",
                publisher=Publisher(w.js, topology),
                dtype=torch.bfloat16,
            )
            masters = step({n: p.detach().clone() for n, p in w.engine.model.named_parameters()}, 1)
            assert {t.dtype for t in masters.values()} == {torch.float32}
            events: list[int] = []
            original_store = sender.store

            async def store(version: int, tensors: dict[str, torch.Tensor]) -> WeightVersionEvent:
                event = await original_store(version, tensors)
                events.append(event.total_bytes)
                assert {s.dtype for s in event.manifest} == {"bfloat16"}, event.manifest
                return event

            sender.store = store  # type: ignore[method-assign]
            await sender.send(1, masters)
            float32_bytes = sum(t.nbytes for t in masters.values())
            assert events and events[0] <= 0.5 * float32_bytes + 64 * 1024, (
                f"stored {events} bytes for {float32_bytes} bytes of float32 masters"
            )
            rounded = {n: t.to(torch.bfloat16).to(torch.float32) for n, t in masters.items()}
            await eventually(
                lambda: serves(w.engine.model, rounded), "the worker serving the bf16 version"
            )

    asyncio.run(main())
