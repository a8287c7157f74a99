"""One rollout worker with two engine replicas behind its router,
on a real nats-server with the tiny HF model.

- least_in_flight: prompts published together are spread over both replicas, which generate
  at the same time (a batcher per replica, each generating in its own thread).
- sticky_by_key: the turns of a conversation (`task.conversation_id`) stay on the replica its
  first turn went to, even when the other replica is idle and least-in-flight would pick it.
- A weight load closes the gate for both replicas, drains both, loads both: no generation on
  either replica overlaps a load on either, every generation runs on one version (the newest
  loaded before it started), and every trajectory's tokens carry one version.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.runtime import publish_config
from bus.topology import PROMPTS, Topology
from engines.protocols import Sample, SamplingParams
from schemas import PromptEvent, Tensor, encode
from schemas import SamplingParams as PromptSampling
from schemas.config import RunConfig
from tests.test_rollout_invariants import (
    GROUP,
    MAX_TOKENS,
    Call,
    RecordingEngine,
    RolloutUnderTest,
    eventually,
    feed,
    overlaps,
    served_rollout,
    trajectories_stored,
)

ROOT = Path(__file__).resolve().parent.parent
REPLICAS = 2
LOAD_SECONDS = 0.4
"""Each replica's load: long enough that a generation would start during it if the gate let one."""
LOADS = 3


class PromptRecordingEngine(RecordingEngine):
    """A recording engine that also keeps the prompts (token ids) it generated."""

    def __init__(self, model_dir: Path, load_seconds: float = 0.0) -> None:
        super().__init__(model_dir, load_seconds)
        self.prompts: list[tuple[int, ...]] = []
        self._prompts_lock = threading.Lock()

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        with self._prompts_lock:
            self.prompts.extend(tuple(p) for p in prompts)
        return super().generate(prompts, n, params)


@asynccontextmanager
async def replicated_worker(
    url: str, topology: Topology, model_dir: Path, router: str, load_seconds: float = 0.0
) -> AsyncIterator[tuple[RolloutUnderTest, list[PromptRecordingEngine]]]:
    """`served_rollout` over REPLICAS recording engines, `router` from the run config."""
    engines = [PromptRecordingEngine(model_dir, load_seconds) for _ in range(REPLICAS)]
    rollout = {"max_batch_prompts": 2, "engine_copies": REPLICAS, "router": router}
    async with served_rollout(url, topology, model_dir, engines, rollout) as (nc, js, rt, worker):
        yield RolloutUnderTest(nc, js, topology, rt, engines[0], worker), engines


def generated(engines: list[PromptRecordingEngine]) -> int:
    return sum(c.prompts for e in engines for c in e.of("generate"))


def test_least_in_flight_spreads_prompts_over_both_replicas_generating_at_once(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    async def main() -> None:
        async with replicated_worker(nats_server.url, topology, model_dir, "least_in_flight") as (
            w,
            engines,
        ):
            await w.publish_weights(0)
            total = 12
            for _ in range(total):
                await w.publish_prompt()
            await eventually(
                lambda: trajectories_stored(w, total * GROUP),
                f"{total * GROUP} trajectories stored",
            )
            per_replica = [sum(c.prompts for c in e.of("generate")) for e in engines]
            assert sum(per_replica) == total, per_replica
            assert min(per_replica) >= total // 4, (
                f"prompts not spread over the replicas: {per_replica}"
            )
            first, second = engines[0].of("generate"), engines[1].of("generate")
            assert any(overlaps(a, b) for a in first for b in second), (
                "the two replicas never generated at the same time: one batcher, or one thread, "
                "for both"
            )

    asyncio.run(main())


def conversation_prompt(
    topology: Topology, index: int, conversation: int, turn: int
) -> PromptEvent:
    """Turn `turn` of conversation `conversation`: token ids unique to the pair, so the engine that
    generated it can be told from its recorded prompts."""
    return PromptEvent(
        id=f"{topology.run}/0/{index}",
        run=topology.run,
        epoch=0,
        index=index,
        token_ids=Tensor.from_numpy(np.array([3, 10 + conversation, 5 + turn], np.int32)),
        n=GROUP,
        sampling=PromptSampling(max_tokens=MAX_TOKENS),
        task={"conversation_id": f"c{conversation}"},
    )


def replica_of(engines: list[PromptRecordingEngine], conversation: int, turn: int) -> int:
    ids = (3, 10 + conversation, 5 + turn)
    found = [i for i, e in enumerate(engines) if ids in e.prompts]
    assert len(found) == 1, f"conversation {conversation} turn {turn} generated on replicas {found}"
    return found[0]


def test_sticky_by_key_keeps_a_conversation_on_its_replica(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    conversations, turns = 4, 3

    async def main() -> None:
        async with replicated_worker(nats_server.url, topology, model_dir, "sticky_by_key") as (
            w,
            engines,
        ):
            await w.publish_weights(0)
            index = 0
            # First turns together: new keys go to the least loaded, so both replicas get some.
            for c in range(conversations):
                await w.js.publish(
                    topology.subject(PROMPTS), encode(conversation_prompt(topology, index, c, 0))
                )
                index += 1
            await eventually(
                lambda: trajectories_stored(w, index * GROUP), "the first turns were generated"
            )
            home = {c: replica_of(engines, c, 0) for c in range(conversations)}
            assert set(home.values()) == set(range(REPLICAS)), f"first turns not spread: {home}"
            # Later turns one at a time, each with every replica idle: least-in-flight would send
            # all of them to replica 0; each must go where its conversation lives.
            for turn in range(1, turns):
                for c in range(conversations):
                    await w.js.publish(
                        topology.subject(PROMPTS),
                        encode(conversation_prompt(topology, index, c, turn)),
                    )
                    index += 1
                    await eventually(
                        lambda: trajectories_stored(w, index * GROUP),  # noqa: B023 - awaited here
                        f"c{c} turn {turn} generated",
                    )
            moved = {
                (c, t): replica_of(engines, c, t)
                for c in range(conversations)
                for t in range(1, turns)
                if replica_of(engines, c, t) != home[c]
            }
            assert not moved, f"turns left their conversation's replica {home}: {moved}"

    asyncio.run(main())


def test_a_weights_load_drains_and_loads_every_replica_and_no_generation_spans_two_versions(
    nats_server: EmbeddedNats, topology: Topology, model_dir: Path
) -> None:
    async def main() -> None:
        async with replicated_worker(
            nats_server.url, topology, model_dir, "least_in_flight", load_seconds=LOAD_SECONDS
        ) as (w, engines):
            await w.publish_weights(0)
            published_at: dict[str, float] = {}
            stop = asyncio.Event()
            feeder = asyncio.create_task(feed(w, stop, published_at))
            try:
                for version in range(1, LOADS + 1):
                    # Both replicas are generating when each version comes.
                    before = [len(e.of("generate")) for e in engines]
                    await eventually(
                        lambda: all(
                            len(e.of("generate")) >= b + 2
                            for e, b in zip(engines, before, strict=True)  # noqa: B023 - awaited here
                        ),
                        f"two generations on each replica before v{version}",
                    )
                    await w.publish_weights(version)
                    # The gate reopens once the load is over (checked below: on every replica).
                    await eventually(
                        lambda: (
                            w.engine.version == version  # noqa: B023 - awaited at once
                            and w.rollout.open_for_requests.is_set()
                        ),
                        f"v{version} was loaded",
                    )
            finally:
                stop.set()
                await feeder
            total = len(published_at)
            await eventually(
                lambda: generated(engines) >= total, f"all {total} prompts were generated"
            )
            await eventually(
                lambda: trajectories_stored(w, total * GROUP),
                f"{total * GROUP} trajectories stored",
            )

            loads: list[Call] = [c for e in engines for c in e.of("load")]
            generations: list[tuple[int, Call]] = [
                (i, g) for i, e in enumerate(engines) for g in e.of("generate")
            ]
            for i, e in enumerate(engines):
                assert [c.version_at_end for c in e.of("load")] == list(range(1, LOADS + 1)), (
                    f"replica {i}"
                )
            clashes = [(i, g, load) for i, g in generations for load in loads if overlaps(g, load)]
            assert not clashes, (
                f"{len(clashes)} generations ran while a replica loaded weights, first: "
                f"{clashes[0]}"
            )
            for i, e in enumerate(engines):  # each replica generated before and after each load
                for load in e.of("load"):
                    assert any(g.end <= load.start for g in e.of("generate")), (
                        f"replica {i}: none before {load}"
                    )
                    assert any(g.start >= load.end for g in e.of("generate")), (
                        f"replica {i}: none after {load}"
                    )
            for i, g in generations:
                served = max((c.version_at_end for c in loads if c.end <= g.start), default=0)
                assert g.version_at_start == g.version_at_end == served, (
                    f"replica {i}: a generation that started after v{served} was loaded ran with "
                    f"v{g.version_at_start}..v{g.version_at_end}: {g}"
                )
            for t in await w.trajectories():
                versions = set(t.versions.numpy().tolist())
                assert len(versions) == 1, f"{t.id}: tokens from several versions {versions}"

    asyncio.run(main())


def test_the_worker_refuses_a_router_that_is_not_one_with_one_line_before_loading_a_model(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    """`rollout.router` names a class without `pick`: `python -m consumers.rollout` exits 1 with one
    line naming it, before it loads the model (the model path here does not exist)."""

    async def setup() -> None:
        nc = await connect(nats_server.url, "test-rollout-router")
        js = nc.jetstream()
        await topology.apply(js)
        config = RunConfig.model_validate(
            {
                "run": topology.run,
                "model": {"path": str(tmp_path / "no-model")},
                "rollout": {"engine_copies": 2, "router": "tests.test_router:NoPick"},
            }
        )
        await publish_config(await js.key_value(topology.kv_bucket), config)
        await nc.close()

    asyncio.run(setup())
    worker = subprocess.run(
        [
            sys.executable,
            "-m",
            "consumers.rollout",
            "--run",
            topology.run,
            "--nats",
            nats_server.url,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert worker.returncode == 1, worker.stderr
    assert worker.stderr.strip().splitlines()[-1] == (
        "consumers.rollout: router 'tests.test_router:NoPick': "
        "NoPick is not a router (no pick(key, in_flight) method)"
    ), worker.stderr
