"""The vLLM and SGLang batch adapters inside the real rollout worker, on a real nats-server:
trajectories carry the trainer's log-probs at the sampling temperature, and a weight version
published through the object store goes into the running engine (the same engine object, its
prefix cache dropped) and changes what it generates with.

Neither engine can run here (no GPU, not installed): the stand-ins of `tests.engine_standins`
answer `vllm.LLM.generate` / `sglang.Engine.generate` by drawing with our HF engine and
reporting as the engine does, and load weights into that HF model. They refuse what the
packages refuse: a function in `collective_rpc` without VLLM_ALLOW_INSECURE_SERIALIZATION
(unset here: the adapter must set it), and SGLang's synchronous calls while the loop it bound
runs (the adapter is built inside the test's running loop, as the worker builds it, and the
worker calls it from `asyncio.to_thread`). Everything else -- the adapters, built by their own
constructors, the rollout, the bus, the weights transport -- is real.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.runtime import attach, publish_config
from bus.stage import serve
from bus.topology import PROMPTS, TRAJECTORIES, WEIGHTS, Topology
from consumers.rollout import Rollout, rollout_stage
from engines.sglang_rollout import SGLangRolloutEngine
from engines.torch_train import LossConfig, TorchTrainEngine
from engines.vllm_rollout import INSECURE_SERIALIZATION_ENV, VLLMRolloutEngine
from schemas import PromptEvent, Tensor, TrajectoryEvent, encode
from schemas import SamplingParams as PromptSampling
from schemas.config import RunConfig
from tests.engine_records import TEMPERATURE, model_dir  # noqa: F401 - a fixture
from tests.engine_standins import sglang_modules, vllm_module
from tests.helpers import store_weights, stream_samples

GROUP = 2


def external_adapter(kind: str, model_dir: Path) -> VLLMRolloutEngine | SGLangRolloutEngine:  # noqa: F811
    """The `kind` batch adapter, built by its own constructor over the stand-in module."""
    if kind == "vllm":
        return VLLMRolloutEngine(model_dir)
    return SGLangRolloutEngine(model_dir)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_trajectories_carry_the_trainers_logprobs_and_weights_load_into_the_running_engine(
    nats_server: EmbeddedNats,
    topology: Topology,
    model_dir: Path,  # noqa: F811
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer = TorchTrainEngine(model_dir, lr=1e-3, loss=LossConfig(temperature=TEMPERATURE))
    modules = vllm_module() if kind == "vllm" else sglang_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv(INSECURE_SERIALIZATION_ENV, "0")
    monkeypatch.delenv(INSECURE_SERIALIZATION_ENV)  # the vLLM adapter must set it (restored after)

    async def main() -> None:
        nc = await connect(nats_server.url, "test-vllm-worker")
        js = nc.jetstream()
        await topology.apply(js)
        config = RunConfig.model_validate(
            {
                "run": topology.run,
                "model": {"path": str(model_dir)},
                "rollout": {"engine": kind, "continuous": False, "max_batch_prompts": 2},
            }
        )
        await publish_config(await js.key_value(topology.kv_bucket), config)
        rt = await attach("rollout", topology.run, nats_server.url)
        engine = external_adapter(kind, model_dir)  # in the running loop, as the worker builds it
        stop = asyncio.Event()
        loop = asyncio.create_task(
            serve(
                rt,
                rollout_stage(Rollout(rt, engine, AutoTokenizer.from_pretrained(model_dir))),
                stop,
            )
        )
        published = 0

        async def prompts(count: int) -> None:
            nonlocal published
            for _ in range(count):
                event = PromptEvent(
                    id=f"{topology.run}/0/{published}",
                    run=topology.run,
                    epoch=0,
                    index=published,
                    token_ids=Tensor.from_numpy(np.array([3, 4, 5, 6 + published % 4], np.int32)),
                    n=GROUP,
                    sampling=PromptSampling(temperature=TEMPERATURE, max_tokens=6),
                )
                published += 1
                await js.publish(topology.subject(PROMPTS), encode(event))

        async def trajectories(count: int) -> list[TrajectoryEvent]:
            """The first `count` samples stored (a group's event holds n)."""
            deadline = time.monotonic() + 60
            while len(stored := await stream_samples(js, topology, TRAJECTORIES)) < count:
                assert time.monotonic() < deadline and not loop.done(), (
                    f"{count} trajectories not stored in 60 s"
                )
                await asyncio.sleep(0.05)
            return [t for t in stored[:count] if isinstance(t, TrajectoryEvent)]

        async def publish_weights(version: int, tensors: dict[str, torch.Tensor]) -> None:
            await js.publish(
                topology.subject(WEIGHTS),
                encode(await store_weights(js, topology, version, tensors)),
            )

        try:
            await publish_weights(
                0, trainer.export_weights()
            )  # opens the gate, as the trainer's v0 does
            await prompts(2)
            first = await trajectories(2 * GROUP)
            new = {k: v + 0.05 * torch.randn(v.shape) for k, v in trainer.export_weights().items()}
            await publish_weights(1, new)
            deadline = time.monotonic() + 60
            while engine.version < 1:
                assert time.monotonic() < deadline and not loop.done(), "v1 was not loaded in 60 s"
                await asyncio.sleep(0.05)
            await prompts(2)
            second = [t for t in await trajectories(4 * GROUP) if t.id not in {f.id for f in first}]
        finally:
            stop.set()
            await asyncio.gather(loop, return_exceptions=True)
            await rt.close()
            await topology.delete(js)
            await nc.close()

        if kind == "vllm":  # once, into the same engine object
            assert engine.llm.events == ["load", "reset prefix cache"]  # type: ignore[union-attr]
        else:
            assert engine.engine.flushed == [True]  # type: ignore[union-attr]
        assert {int(v) for t in first for v in t.versions.numpy()} == {0}
        assert {int(v) for t in second for v in t.versions.numpy()} == {1}
        check_logprobs(trainer, first)
        with torch.no_grad():
            for name, param in trainer.model.named_parameters():
                param.copy_(new[name])
        check_logprobs(trainer, second)

    asyncio.run(main())


def check_logprobs(trainer: TorchTrainEngine, trajectories: list[TrajectoryEvent]) -> None:
    """Each trajectory's log-probs are what `trainer` computes for its response tokens."""
    for t in trajectories:
        prompt, response = t.prompt_ids.numpy().tolist(), t.response_ids.numpy().tolist()
        ids = torch.tensor([prompt + response])
        expected = trainer.logprobs(ids, torch.ones_like(ids))[0, len(prompt) :]
        got = torch.from_numpy(t.logprobs.numpy().copy())
        torch.testing.assert_close(
            got,
            expected,
            atol=1e-5,
            rtol=0,
            msg=lambda m, t=t: f"{t.id}: {m}",  # type: ignore[misc]  # the default binds the loop
        )
