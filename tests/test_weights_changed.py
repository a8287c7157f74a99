"""Issue 28 in the rollout worker, on a real nats-server, a real filesystem transport and a real
HF engine: only the tensors whose bytes differ from what the engine holds reach it, whether a
version comes as a delta or whole; a load that does not read back is loaded again whole, and
the receiver counts a version as served only once the engine confirmed it.

What the engine holds is the manifest (sha256 per tensor) of the last version it confirmed:
nothing at the start (the first version goes in whole), then each version's changed tensors.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.topology import WEIGHTS, Topology
from consumers.weights import Ready, WeightsReceiver, WeightsSender, transport_for
from engines.external_rollout import skeleton
from engines.hf_rollout import HFRolloutEngine
from schemas import WeightVersionEvent, encode
from schemas.config import WeightsConfig
from tests.helpers import store_weights
from tests.test_rollout_invariants import eventually, served_rollout
from tests.test_weight_chain import serves


class NamingEngine(HFRolloutEngine):
    """The real engine, recording the names each load was handed; `lose` names tensors its
    next copy passes over once (a load the read-back must catch)."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir, seed=0)
        self.loads: list[set[str]] = []
        self.lose: set[str] = set()

    def load_state_dict(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        self.loads.append(set(tensors))
        super().load_state_dict(tensors, version)

    def _copy(
        self, params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]
    ) -> None:
        lost, self.lose = self.lose, set()
        super()._copy({n: p for n, p in params.items() if n not in lost}, tensors)


def moved(tensors: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    """`tensors` with `names` nudged (new bytes), the others the same objects' values."""
    return {n: (t + 1e-2 if n in names else t).clone() for n, t in tensors.items()}


def test_only_changed_tensors_reach_the_engine_and_a_load_that_does_not_read_back_goes_in_whole(
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
        engine = NamingEngine(model_dir)
        names = [n for n, _ in engine.model.named_parameters()]
        async with served_rollout(
            nats_server.url,
            topology,
            model_dir,
            engine,
            {"max_batch_prompts": 2},
            weights=settings,
        ) as (_, js, _, rollout):
            config = WeightsConfig.model_validate(settings)

            def sender(cfg: WeightsConfig) -> WeightsSender:
                store = transport_for(cfg, js, topology.object_bucket, topology.run)
                return WeightsSender(store, cfg, topology.run, "test")

            chain, whole = sender(config), sender(config.model_copy(update={"delta": False}))

            async def announce(event: WeightVersionEvent) -> None:
                await js.publish(topology.subject(WEIGHTS), encode(event))

            async def served(version: int, tensors: dict[str, torch.Tensor]) -> None:
                await eventually(
                    lambda: rollout.receiver.version == version, f"v{version} was served"
                )
                assert engine.version == version and serves(engine.model, tensors)

            v0 = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
            await announce(await chain.store(0, v0))
            await eventually(lambda: rollout.open_for_requests.is_set(), "v0 was handled")
            assert engine.loads == [], "v0 is what the worker started with"

            # What the engine started with is unknown: the first version goes in whole.
            v1 = moved(v0, names[:1])
            await announce(await chain.store(1, v1))
            await served(1, v1)
            assert engine.loads == [set(names)], [len(n) for n in engine.loads]

            # A delta that moves a third of the tensors (the others frozen): only those.
            v2 = moved(v1, names[::3])
            await announce(await chain.store(2, v2))
            await served(2, v2)
            assert engine.loads[-1] == set(names[::3]), sorted(engine.loads[-1])

            # A full version, one tensor different from v2: only that one.
            v3 = moved(v2, names[1:2])
            await announce(await whole.store(3, v3))
            await served(3, v3)
            assert engine.loads[-1] == {names[1]}, sorted(engine.loads[-1])

            # The engine's copy loses a tensor: the read-back refuses the load, which goes in
            # again whole; v4 is served only then.
            v4 = moved(v3, names[2::3])
            engine.lose = {names[5]}
            await announce(await whole.store(4, v4))
            await served(4, v4)
            assert engine.loads[-2:] == [set(names[2::3]), set(names)], [
                len(n) for n in engine.loads
            ]

            # And the next version is counted from v4.
            v5 = moved(v4, names[:1])
            await announce(await whole.store(5, v5))
            await served(5, v5)
            assert engine.loads[-1] == {names[0]}, sorted(engine.loads[-1])

    asyncio.run(main())


def test_a_version_the_stage_did_not_confirm_leaves_the_next_one_to_go_in_whole(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    """The receiver on its own: a stage that asks for the next version without confirming the
    last (`loaded`) may have put some of its tensors in, so nothing is known to be held."""

    async def main() -> None:
        nc = await connect(nats_server.url, "test-receiver")
        js = nc.jetstream()
        await topology.apply(js)
        model = skeleton(model_dir)
        names = [n for n, _ in model.named_parameters()]
        receiver = WeightsReceiver(js, topology, Publisher(js, topology), WeightsConfig(), model)
        v1 = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
        versions = {1: v1, 2: moved(v1, names[:1]), 3: moved(moved(v1, names[:1]), names[1:2])}
        follow = receiver.follow()

        async def next_version(version: int) -> Ready:
            # `weights` is followed from its last stored event on: one version at a time.
            event = await store_weights(js, topology, version, versions[version])
            await js.publish(topology.subject(WEIGHTS), encode(event))
            ready = await asyncio.wait_for(anext(follow), 30)
            assert ready.event.version == version
            return ready

        try:
            first = await next_version(1)
            assert first.changed == set(names)  # nothing known at the start
            receiver.loaded(first)
            second = await next_version(2)
            assert second.changed == {names[0]} and receiver.version == 1
            third = await next_version(3)  # v2 not confirmed
            assert third.changed == set(names) and receiver.version == 1
            await follow.aclose()
        finally:
            await topology.delete(js)
            await nc.close()

    asyncio.run(main())
