"""Delta versions end to end: the trainer's `Publisher` stores full and delta versions through a
real transport, real rollout workers (real nats-server, real tiny HF engine) load them.

- A worker that follows the chain loads each delta, and serves weights bit for bit equal to
  the trainer's; the deltas are a fraction of a full version's bytes.
- A worker that starts late (its first event a delta) pulls the chain's full version, then
  every delta up to the event's version, and serves the same bits.
- A delta whose result does not match its checksum (encoded against another base) is
  refused, dead-lettered, and both workers keep serving (and generating with) the version they had.

Run with either transport that stores bytes (object store, filesystem).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from bus.embedded import EmbeddedNats
from bus.topology import WEIGHTS, Topology
from consumers.weights import transport_for
from consumers.weights.sender import WeightsSender
from schemas import WeightVersionEvent, encode
from schemas.config import WeightsConfig
from tests.helpers import dead_letters
from tests.test_rollout_invariants import dead_stored, eventually, rollout_worker

PROMPTS_TO_REACH_BOTH = 20
"""Prompts sent at most, one at a time, until each of two competing workers has taken one."""


def step(tensors: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """The next version: about 5% of each tensor's elements moved a little (fp32, as the model)."""
    generator = torch.Generator().manual_seed(version)
    out = {}
    for name, t in tensors.items():
        moved = torch.rand(t.shape, generator=generator) < 0.05
        out[name] = torch.where(
            moved, t + 1e-3 * torch.randn(t.shape, generator=generator), t
        ).contiguous()
    return out


def serves(engine_model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    """Whether the model's parameters are `tensors`, bit for bit."""
    params = dict(engine_model.named_parameters())
    return set(params) == set(tensors) and all(
        torch.equal(params[n].detach().view(torch.int32), t.view(torch.int32))
        for n, t in tensors.items()
    )


@pytest.mark.parametrize("transport", ["object_store", "filesystem"])
def test_rollout_workers_follow_delta_versions_bit_for_bit_and_a_late_one_catches_up(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path, tmp_path: Path, transport: str
) -> None:
    async def main() -> None:
        settings = {
            "transport": transport,
            "dir": str(tmp_path),
            "delta": True,
            "full_every": 8,
            "keep": 2,
        }
        async with rollout_worker(nats_server.url, topology, model_dir, weights=settings) as w:
            config = WeightsConfig.model_validate(settings)
            publisher = WeightsSender(
                transport_for(config, w.js, topology.object_bucket, topology.run),
                config,
                topology.run,
                "test",
            )

            async def announce(
                version: int, tensors: dict[str, torch.Tensor]
            ) -> WeightVersionEvent:
                event = await publisher.store(version, tensors)
                await w.js.publish(topology.subject(WEIGHTS), encode(event))
                return event

            versions = {0: {n: p.detach().clone() for n, p in w.engine.model.named_parameters()}}
            full = await announce(0, versions[0])
            assert (full.base_version, full.full_version, full.shards) == (None, 0, ())
            for version in (1, 2, 3):
                versions[version] = step(versions[version - 1], version)
                event = await announce(version, versions[version])
                assert (event.base_version, event.full_version) == (version - 1, 0)
                assert event.total_bytes < 0.25 * full.total_bytes, (
                    event.total_bytes,
                    full.total_bytes,
                )
                await eventually(lambda v=version: w.engine.version == v, f"v{version} was loaded")  # type: ignore[misc]  # the default binds the loop value
                assert serves(w.engine.model, versions[version]), (
                    f"v{version} is not the trainer's bits"
                )
            # The chain's versions are pinned: the full v0 is kept though `keep` is 2.
            async with rollout_worker(
                nats_server.url, topology, model_dir, weights=settings
            ) as late:
                await eventually(
                    lambda: late.engine.version == 3 or dead_stored(w, 1),
                    "the late worker handled v3",
                )
                assert late.engine.version == 3, (
                    "the late worker did not load v3: "
                    f"{[r for _, r in await dead_letters(w.js, topology)]}"
                )
                assert serves(late.engine.model, versions[3]), (
                    "the late worker's v3 is not the trainer's bits"
                )
                assert [load.version_at_end for load in late.engine.of("load")] == [3]

                # v4 encoded against another base: its result fails the checksum.
                publisher.base = {n: t + 1e-2 for n, t in publisher.base.items()}
                versions[4] = step(versions[3], 4)
                await announce(4, versions[4])
                for worker in (
                    w,
                    late,
                ):  # v4 handled: applied (copy at v4), or refused (copy dropped)
                    await eventually(
                        lambda x=worker: x.rollout.receiver.chain.version != 3,  # type: ignore[misc]
                        "v4 was handled",
                    )
                    # Refused: the copy is dropped (the next version pulls the full one).
                    assert worker.rollout.receiver.chain.version is None, (
                        f"v4 applied: copy at v{worker.rollout.receiver.chain.version}"
                    )
                await eventually(lambda: dead_stored(w, 1), "v4 was dead-lettered")
                assert w.engine.version == 3 and serves(w.engine.model, versions[3]), (
                    "a failed delta changed the weights"
                )
                assert late.engine.version == 3 and serves(late.engine.model, versions[3])
                reasons = [reason for _, reason in await dead_letters(w.js, topology)]
                # One dead letter: the message id is the event's, so both workers' letters are one.
                assert len(reasons) == 1 and "checksum" in reasons[0], reasons
                # Both workers keep generating with v3. They compete for prompts, so prompts go
                # out one at a time until each worker has generated one (which takes a prompt is
                # the server's choice).
                workers = {"w": w, "late": late}

                def generated() -> dict[str, int]:
                    return {name: len(x.engine.of("generate")) for name, x in workers.items()}

                before = generated()
                for _ in range(PROMPTS_TO_REACH_BOTH):
                    now = generated()
                    if all(now[name] > before[name] for name in workers):
                        break
                    await w.publish_prompt()
                    total = sum(now.values())
                    await eventually(
                        lambda t=total: sum(generated().values()) > t,  # type: ignore[misc]  # binds the loop value
                        "a prompt was generated after v4",
                    )
                for name, x in workers.items():
                    after = x.engine.of("generate")[before[name] :]
                    assert after, (
                        f"{name} generated nothing in {PROMPTS_TO_REACH_BOTH} prompts after v4"
                    )
                    assert [g.version_at_start for g in after] == [3] * len(after), (
                        f"{name} left v3"
                    )
                    assert x.rollout.open_for_requests.is_set(), f"{name}'s gate stayed closed"

    asyncio.run(main())
