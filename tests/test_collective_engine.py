"""The collective transport ending in the engine's own memory, over gloo, on a real nats-server.

The trainer's source (this process) broadcasts three versions to two rollout workers, each its
own process (tests/collective_engine_proc.py): one with our HF engine, which joins the group
and receives into its own parameters, one with the real SGLang batch adapter over the
stand-in `sglang.Engine`, whose `init_weights_update_group` / `update_weights_from_distributed`
join a real gloo group through SGLang's rendezvous (`init_custom_process_group` over
``tcp://``) and receive one broadcast per tensor into tensors of their own.

A third member, in the test process, has no engine that takes a broadcast: it receives, in the
same group, tensor by tensor into its staging buffer, and ends with every version bit for bit.

- v1: both engines end with exactly the trainer's tensors, by broadcast (no stored copy).
- v2: the SGLang stand-in's group breaks mid-broadcast, every attempt: the source gives up,
  and both workers load the stored copy: again exactly the trainer's tensors.
- v3: the SGLang stand-in's loader passes over the tensor its read-back probes: it takes
  the stored copy; the HF worker, by broadcast.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.topology import Topology
from consumers.weights import transport_for
from consumers.weights.sender import WeightsSender
from engines.external_rollout import skeleton
from engines.sglang_group import probes
from engines.weights import dtype_name, tensor_sha256
from schemas.config import WeightsConfig
from tests import collective_engine_proc
from tests.engine_records import model_dir  # noqa: F401 - a fixture

MEMBERS = ("worker-hf", "worker-sglang")
STAGING = "worker-staging"
"""A third member, in this process: receives into its staging buffer (the path of engines that
cannot take a broadcast), tensor by tensor in the same group as the engines."""


def version(model: Path, v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + v)
    return {n: torch.randn(p.shape, generator=g) for n, p in skeleton(model).named_parameters()}


def probed(tensors: dict[str, torch.Tensor]) -> str:
    """The tensor the SGLang adapter reads back (one bucket: the smallest)."""
    specs = [(n, dtype_name(t), list(t.shape)) for n, t in tensors.items()]
    return probes(specs, 512 << 20, {})[0][0]


def test_a_version_ends_in_the_engines_and_a_failed_one_in_the_stored_copy(
    nats_server: EmbeddedNats,
    topology: Topology,
    model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    versions = {v: version(model_dir, v) for v in (1, 2, 3)}
    faults = {"2": {"break_at": 2}, "3": {"skip": [probed(versions[3])]}}
    ctx = mp.get_context("spawn")
    workers = [
        ctx.Process(
            target=collective_engine_proc.worker_main,
            args=(
                member,
                kind,
                str(model_dir),
                nats_server.url,
                topology.run,
                topology.object_bucket,
                str(tmp_path),
                json.dumps(faults),
            ),
        )  # fmt: skip
        for member, kind in zip(MEMBERS, ("hf", "sglang"), strict=True)
    ]
    for w in workers:
        w.start()
    published, staged = {}, {}
    try:

        async def main() -> None:
            nc = await connect(nats_server.url, "test-collective-engine")
            js = nc.jetstream()
            await topology.apply(js)
            config = WeightsConfig.model_validate(collective_engine_proc.SETTINGS)

            async def listed() -> list[str]:
                return [*MEMBERS, STAGING]

            trainer = transport_for(
                config, js, topology.object_bucket, topology.run, members=listed
            )
            staging = transport_for(
                config, js, topology.object_bucket, topology.run, "collective", member_id=STAGING
            )
            sender = WeightsSender(trainer, config, topology.run, "test", dtype=torch.float32)
            deadline = time.monotonic() + 120
            while not all((tmp_path / f"{m}.ready").exists() for m in MEMBERS):
                assert time.monotonic() < deadline, "the workers did not start"
                await asyncio.sleep(0.1)
            try:
                for v, tensors in versions.items():
                    event = await sender.store(v, tensors)
                    # Written whole, then renamed: a worker polls for the name and must never
                    # read it half written (it read '' once in CI).
                    (tmp_path / f"event{v}.tmp").write_text(event.model_dump_json())
                    (tmp_path / f"event{v}.tmp").replace(tmp_path / f"event{v}.json")
                    fetching = asyncio.create_task(staging.fetch(event))
                    await sender.announced(v, tensors)
                    published[v] = await trainer.settle()  # type: ignore[attr-defined]
                    staged[v] = await fetching
            finally:
                await trainer.close()  # type: ignore[attr-defined]
                await staging.close()  # type: ignore[attr-defined]
                await nc.close()

        asyncio.run(main())
        for w in workers:
            w.join(timeout=120)
            assert w.exitcode == 0, f"a worker ended with {w.exitcode}"
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()

    def got(member: str, v: int) -> dict:
        return torch.load(tmp_path / f"{member}-v{v}.pt")

    def exact(member: str, v: int) -> bool:
        params = got(member, v)["params"]
        return params.keys() == versions[v].keys() and all(
            tensor_sha256(params[n]) == tensor_sha256(t) for n, t in versions[v].items()
        )

    everyone = (*MEMBERS, STAGING)
    for v, tensors in versions.items():  # by broadcast (v1, v3) or from the copy (v2)
        assert staged[v].keys() == tensors.keys(), f"the staging member's v{v}"
        assert all(tensor_sha256(staged[v][n]) == tensor_sha256(t) for n, t in tensors.items())
    # v1: into both engines by broadcast, bit for bit.
    assert published[1].members == everyone and not published[1].reason, published[1]
    for m in MEMBERS:
        assert not got(m, 1)["fallback"], f"{m} missed v1"
        assert exact(m, 1) and got(m, 1)["version"] == 1, f"{m} does not hold the trainer's v1"
    # v2: the group broke mid-broadcast on every attempt; both load the stored copy.
    assert published[2].members == () and "attempt" in published[2].reason, published[2]
    for m in MEMBERS:
        assert got(m, 2)["fallback"], f"{m} did not take the stored copy of v2"
        assert exact(m, 2), f"{m} does not hold the trainer's v2"
    # v3: the SGLang read-back disagrees -> the stored copy; HF by broadcast.
    assert published[3].members == everyone, published[3]
    assert got("worker-sglang", 3)["fallback"], "a load that did not read back was kept"
    assert not got("worker-hf", 3)["fallback"]
    for m in MEMBERS:
        assert exact(m, 3), f"{m} does not hold the trainer's v3"
