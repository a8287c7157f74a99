"""The vLLM adapter inside the real rollout worker, on a real nats-server: trajectories carry the
trainer's log-probs at the sampling temperature, and a weight version published through the
object store goes into the running engine (the same engine object, its prefix cache dropped)
and changes what it generates with.

vLLM itself cannot run here (no GPU, not installed): `StandInLLM` answers `LLM.generate` by
drawing with our HF engine and reporting as vLLM does (`tests.engine_records.vllm_report`),
and `LLM.collective_rpc` by running the adapter's worker function on an object holding that
HF model. Everything else -- the adapter, the rollout, the bus, the weights transport -- is real.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.runtime import attach, publish_config
from bus.stage import serve
from bus.topology import PROMPTS, TRAJECTORIES, WEIGHTS, Topology
from consumers.rollout import Rollout, rollout_stage
from engines.external_rollout import skeleton
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import SamplingParams
from engines.torch_train import LossConfig, TorchTrainEngine
from engines.vllm_rollout import VLLMRolloutEngine
from schemas import PromptEvent, Tensor, TrajectoryEvent, decode, encode
from schemas import SamplingParams as PromptSampling
from schemas.config import RunConfig
from tests.engine_records import TEMPERATURE, model_dir, vllm_objects, vllm_report  # noqa: F401 - a fixture
from tests.helpers import store_weights

GROUP = 2


class StandInLLM:
    """`vllm.LLM`'s generate / collective_rpc / reset_prefix_cache over our HF engine."""

    def __init__(self, hf: HFRolloutEngine) -> None:
        self.hf = hf
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=self))
        self.events: list[str] = []

    def generate(
        self, prompts: list[dict[str, list[int]]], sampling: dict[str, Any], use_tqdm: bool
    ) -> list[Any]:
        ids = [p["prompt_token_ids"] for p in prompts]
        params = SamplingParams(
            sampling["temperature"],
            sampling["top_p"],
            sampling["max_tokens"],
            tuple(sampling["stop_token_ids"]),
        )
        return vllm_objects(vllm_report(ids, self.hf.generate(ids, sampling["n"], params)))

    def load_weights(self, weights: Any) -> None:  # the worker's model_runner.model
        params = dict(self.hf.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = ()) -> list[Any]:
        self.events.append("load")
        return [method(self.worker, *args)]

    def reset_prefix_cache(self) -> bool:
        self.events.append("reset prefix cache")
        return True


def vllm_adapter(model_dir: Path) -> tuple[VLLMRolloutEngine, StandInLLM]:  # noqa: F811
    """The adapter as its constructor leaves it, with the stand-in in place of `vllm.LLM`."""
    hf = HFRolloutEngine(model_dir, seed=0)
    engine = object.__new__(VLLMRolloutEngine)
    llm = StandInLLM(hf)
    engine.model, engine.eos_token_ids, engine.dtype = skeleton(model_dir), hf.eos_token_ids, None
    engine._vllm = SimpleNamespace(SamplingParams=lambda **kw: kw)  # type: ignore[assignment]
    engine.llm, engine.version = llm, 0  # a stand-in vllm module above, the LLM here
    return engine, llm


def test_trajectories_carry_the_trainers_logprobs_and_weights_load_into_the_running_engine(
    nats_server: EmbeddedNats,
    topology: Topology,
    model_dir: Path,  # noqa: F811
) -> None:
    trainer = TorchTrainEngine(model_dir, lr=1e-3, loss=LossConfig(temperature=TEMPERATURE))

    async def main() -> None:
        nc = await connect(nats_server.url, "test-vllm-worker")
        js = nc.jetstream()
        await topology.apply(js)
        config = RunConfig.model_validate(
            {
                "run": topology.run,
                "model": {"path": str(model_dir)},
                "rollout": {"engine": "vllm", "max_batch_prompts": 2},
            }
        )
        await publish_config(await js.key_value(topology.kv_bucket), config)
        rt = await attach("rollout", topology.run, nats_server.url)
        engine, llm = vllm_adapter(model_dir)
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
            deadline = time.monotonic() + 60
            while (await js.stream_info(topology.stream(TRAJECTORIES))).state.messages < count:
                assert time.monotonic() < deadline and not loop.done(), (
                    f"{count} trajectories not stored in 60 s"
                )
                await asyncio.sleep(0.05)
            sub = await js.subscribe(topology.subject(TRAJECTORIES), ordered_consumer=True)
            try:
                return [
                    decode((await sub.next_msg(timeout=5)).data, TrajectoryEvent)
                    for _ in range(count)
                ]
            finally:
                await sub.unsubscribe()

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

        assert llm.events == ["load", "reset prefix cache"]  # once, into the same engine object
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
