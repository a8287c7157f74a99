"""The continuous vLLM and SGLang adapters on CPU, over fakes of the engine objects only
(`tests.continuous_fakes`: the tiny HF model decoding token by token, as the engine would
report it): request building, stream -> `Sample`, per-token versions and log-prob alignment
with the trainer across a pause / load / resume in both partial modes, slot accounting, error
paths, vLLM's weight buckets (the fake refuses a function in collective_rpc without
VLLM_ALLOW_INSECURE_SERIALIZATION, as vLLM does, so every load also shows the adapter set it),
and the rollout worker driving the vLLM adapter over a real nats-server through a
weight version change. The real engines: tests/test_gpu_engines.py (GPU only)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

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
from engines.continuous import ContinuousAdapter
from engines.protocols import ContinuousEngine, SamplingParams
from engines.sglang_continuous import continuous_engine_kwargs, stream_delta
from engines.sglang_rollout import SGLangSettings
from engines.torch_train import LossConfig, TorchTrainEngine
from engines.vllm_continuous import async_engine_kwargs, delta_chunk, request_kwargs
from engines.vllm_rollout import INSECURE_SERIALIZATION_ENV, VLLMSettings
from schemas import PromptEvent, Tensor, TrajectoryEvent, decode, encode
from schemas import SamplingParams as PromptSampling
from schemas.config import RunConfig
from tests.continuous_fakes import DELTA, FakeCore, adapter
from tests.engine_records import TEMPERATURE, load, model_dir  # noqa: F401 - a fixture
from tests.engine_standins import HEADER_SLACK
from tests.helpers import store_weights

API = load("engine_api.json")
PROMPTS_IDS = [[3, 4, 5, 6 + i % 4] for i in range(8)]


def test_requests_are_one_sample_each_streamed_as_deltas_in_the_engines_field_names() -> None:
    params = SamplingParams(temperature=0.7, max_tokens=12, stop_token_ids=(7,))
    kwargs = request_kwargs(params, (2,), DELTA)
    assert set(kwargs) <= set(API["vllm"]["SamplingParams"]), set(kwargs) - set(
        API["vllm"]["SamplingParams"]
    )
    assert (kwargs["n"], kwargs["logprobs"], kwargs["output_kind"], kwargs["stop_token_ids"]) == (
        1,
        0,
        DELTA,
        [2, 7],
    )
    engine = async_engine_kwargs(Path("/m"), VLLMSettings(), slots=48)
    assert set(engine) <= set(API["vllm"]["EngineArgs"]) and engine["max_num_seqs"] == 48, engine
    assert engine["logprobs_mode"] == "processed_logprobs"
    server = continuous_engine_kwargs(Path("/m"), SGLangSettings(), slots=48)
    assert (
        set(server) <= set(API["sglang"]["ServerArgs"]) and server["max_running_requests"] == 48
    ), server
    with pytest.raises(ValueError, match="needs top_p 1"):
        request_kwargs(SamplingParams(top_p=0.9), (2,), DELTA)


def vllm_output(
    tokens: list[int], logprobs: list[float], finish: str | None, finished: bool
) -> SimpleNamespace:
    completion = SimpleNamespace(
        index=0,
        token_ids=tokens,
        finish_reason=finish,
        logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logprobs, strict=True)],
    )
    return SimpleNamespace(finished=finished, outputs=[completion])


def test_engine_outputs_become_chunks_and_malformed_ones_are_refused() -> None:
    chunk = delta_chunk(vllm_output([5, 2], [-0.5, -0.25], "stop", True))
    assert (chunk.token_ids, chunk.logprobs, chunk.finish_reason) == ((5, 2), (-0.5, -0.25), "stop")
    assert delta_chunk(vllm_output([5], [-0.5], None, False)).finish_reason is None
    assert (
        delta_chunk(vllm_output([], [], None, True)).finish_reason == "abort"
    )  # finished with no reason
    wrong = vllm_output([5], [-0.5], None, False)
    wrong.outputs[0].logprobs = [{6: SimpleNamespace(logprob=-1.0)}]
    with pytest.raises(ValueError, match="no log-prob for its sampled token 5"):
        delta_chunk(wrong)

    def sglang(entries: list[tuple[float, int]], total: int, finish: dict | None = None) -> dict:
        return {
            "meta_info": {
                "output_token_logprobs": [[lp, t, None] for lp, t in entries],
                "completion_tokens": total,
                "finish_reason": finish,
            }
        }

    cumulative, seen = stream_delta(
        sglang([(-0.5, 5), (-0.25, 6)], 2), 1
    )  # everything so far: one new
    assert (cumulative.token_ids, cumulative.logprobs, seen) == ((6,), (-0.25,), 2)
    incremental, seen = stream_delta(sglang([(-0.125, 2)], 3, {"type": "stop", "matched": 2}), 2)
    assert (incremental.token_ids, incremental.finish_reason, seen) == ((2,), "stop", 3)
    with pytest.raises(ValueError, match="3 log-probs in a chunk, 5 tokens so far, 1 seen"):
        stream_delta(sglang([(-1.0, 1)] * 3, 5), 1)
    with pytest.raises(ValueError, match="output_token_logprobs"):
        stream_delta({"meta_info": {}}, 0)


def trainer_logprobs(
    trainer: TorchTrainEngine, prompt: list[int], response: list[int]
) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    return trainer.logprobs(ids, torch.ones_like(ids))[0, len(prompt) :]


def logprobs_under(
    trainer: TorchTrainEngine,
    weights: dict[str, torch.Tensor],
    prompt: list[int],
    response: list[int],
) -> torch.Tensor:
    """The trainer's log-probs of `response` after `prompt` with its parameters set to `weights`."""
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            p.copy_(weights[name])
    return trainer_logprobs(trainer, prompt, response)


def tokens_in(core: FakeCore, least: int) -> bool:
    """Every request in the engine has computed `least` tokens (and some are there)."""
    active = dict(core.active)
    return bool(active) and min(active.values()) >= least


@pytest.mark.parametrize(
    "kind, mode",
    [("vllm", "resubmit"), ("vllm", "keep"), ("sglang", "resubmit"), ("sglang", "keep")],
)
def test_samples_in_flight_go_on_with_the_new_weights_each_token_tagged_and_aligned(
    model_dir: Path,  # noqa: F811 - the fixture imported above
    kind: str,
    mode: str,
) -> None:
    core = FakeCore(model_dir)
    engine = adapter(kind, model_dir, core, slots=8, mode=mode)  # type: ignore[arg-type]
    assert isinstance(engine, ContinuousEngine)
    trainer = TorchTrainEngine(model_dir, lr=1e-3, loss=LossConfig(temperature=TEMPERATURE))
    old = trainer.export_weights()
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
        for k, v in old.items()
    }
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=24)
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(engine.generate_sample, p, params) for p in PROMPTS_IDS]
            deadline = time.monotonic() + 30
            while not tokens_in(core, 3):
                assert time.monotonic() < deadline, f"samples never got 3 tokens in: {core.active}"
                time.sleep(0.002)
            engine.pause()
            engine.load_state_dict(new, version=1)
            engine.resume()
            samples = [f.result(timeout=60) for f in futures]
    finally:
        engine.close()
    assert core.violations == [], core.violations
    assert core.loads == 1 and engine.version == 1 and engine.in_flight == 0
    spanning = 0
    for prompt, sample in zip(PROMPTS_IDS, samples, strict=True):
        assert sample.versions is not None  # a continuous engine tags every token
        versions = sample.versions.tolist()
        assert len(versions) == len(sample.token_ids) == len(sample.logprobs)
        assert versions == sorted(versions) and set(versions) <= {0, 1}, versions
        spanning += {0, 1} <= set(versions)
        response = sample.token_ids.tolist()
        under_old = logprobs_under(trainer, old, prompt, response)
        under_new = logprobs_under(trainer, new, prompt, response)
        # Each token's log-prob is the trainer's under the version it is tagged with.
        expected = torch.where(sample.versions == 1, under_new, under_old)
        torch.testing.assert_close(sample.logprobs, expected, atol=1e-5, rtol=0)
    assert spanning, f"no sample spanned the load: {[s.versions.tolist() for s in samples]}"  # type: ignore[union-attr]
    if mode == "resubmit":  # each sample went on as prompt + its tokens so far
        resubmitted = [(prompt, limit) for _, prompt, limit in core.submitted[len(PROMPTS_IDS) :]]
        assert resubmitted and all(
            limit == 24 - (len(prompt) - 4) for prompt, limit in resubmitted
        ), resubmitted
        assert any(event.startswith("abort") for event in core.events), core.events
    else:
        assert core.events[:3] == ["pause", "load", "resume"] or "pause" in core.events, core.events
        assert len(core.submitted) == len(PROMPTS_IDS), "keep mode resubmitted a request"


def test_slots_are_counted_and_a_sample_beyond_them_is_refused(model_dir: Path) -> None:  # noqa: F811
    core = FakeCore(model_dir, seconds_per_token=0.01)
    engine = adapter("vllm", model_dir, core, slots=2)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=20, stop_token_ids=())
    try:
        with ThreadPoolExecutor(3) as pool:
            running = [pool.submit(engine.generate_sample, [3, 4, 5], params) for _ in range(2)]
            deadline = time.monotonic() + 10
            while engine.in_flight < 2:
                assert time.monotonic() < deadline
                time.sleep(0.002)
            with pytest.raises(RuntimeError, match="beyond the engine's 2 slots"):
                engine.generate_sample([3, 4, 5], params)
            with pytest.raises(RuntimeError, match="weights loaded while 2 samples generate"):
                engine.load_state_dict({}, version=1)
            [f.result(timeout=30) for f in running]
        assert engine.in_flight == 0
    finally:
        engine.close()


def test_the_vllm_adapter_loads_a_version_in_rpcs_of_at_most_the_bucket_bytes(
    model_dir: Path,  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(INSECURE_SERIALIZATION_ENV, "0")
    monkeypatch.delenv(INSECURE_SERIALIZATION_ENV)  # the adapter must set it (restored after)
    core, bucket = FakeCore(model_dir), 128 * 1024
    engine = adapter("vllm", model_dir, core, bucket_bytes=bucket)
    new = {n: torch.randn(p.shape) for n, p in engine.model.named_parameters()}
    total = sum(t.numel() * t.element_size() for t in new.values())
    try:
        engine.load_state_dict(new, version=1)
    finally:
        engine.close()
    sent = engine.engine.rpc_bytes  # type: ignore[attr-defined]
    assert max(sent) <= bucket + HEADER_SLACK and len(sent) >= total / bucket > 2, sent
    assert total <= sum(sent) <= total + HEADER_SLACK * len(sent), (total, sent)
    assert core.events == ["load"] * len(sent) + ["reset prefix cache"], core.events
    for name, param in core.hf.named_parameters():
        assert torch.equal(param, new[name]), name


def test_an_abort_the_worker_did_not_ask_for_and_an_empty_prompt_are_errors(
    model_dir: Path,  # noqa: F811 - the fixture imported above
) -> None:
    core = FakeCore(model_dir)
    engine = adapter("vllm", model_dir, core, finish_override="abort")
    try:
        with pytest.raises(ValueError, match="finished by 'abort'"):
            engine.generate_sample([3, 4, 5], SamplingParams(temperature=TEMPERATURE, max_tokens=3))
        with pytest.raises(ValueError, match="empty prompt"):
            engine.generate_sample([], SamplingParams())
        assert engine.in_flight == 0
    finally:
        engine.close()


def test_generate_batches_through_the_same_requests(model_dir: Path) -> None:  # noqa: F811
    core = FakeCore(model_dir)
    engine: ContinuousAdapter = adapter("sglang", model_dir, core)
    try:
        groups = engine.generate(
            PROMPTS_IDS[:2], 3, SamplingParams(temperature=TEMPERATURE, max_tokens=5)
        )
    finally:
        engine.close()
    assert [len(g) for g in groups] == [3, 3] and len(core.submitted) == 6
    # A continuous engine tags every token with its version.
    assert all(s.versions.tolist() == [0] * len(s.token_ids) for g in groups for s in g)  # type: ignore[union-attr]


def test_the_rollout_worker_drives_the_vllm_adapter_through_a_version_change(
    nats_server: EmbeddedNats,
    topology: Topology,
    model_dir: Path,  # noqa: F811
) -> None:
    """Continuous admission and partial rollout on the (faked) vLLM engine over the real bus:
    v1 is published while samples are mid-way; they go on with it, each token's version and
    log-prob as the trainer computes them under that version."""
    trainer = TorchTrainEngine(model_dir, lr=1e-3, loss=LossConfig(temperature=TEMPERATURE))
    old = trainer.export_weights()
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(2))
        for k, v in old.items()
    }
    core = FakeCore(
        model_dir, seconds_per_token=0.03
    )  # ~1 s a sample: longer than a load takes here
    engine = adapter("vllm", model_dir, core, slots=8)
    group, count = 2, 4

    async def main() -> list[TrajectoryEvent]:
        nc = await connect(nats_server.url, "test-continuous-worker")
        js = nc.jetstream()
        await topology.apply(js)
        config = RunConfig.model_validate(
            {
                "run": topology.run,
                "model": {"path": str(model_dir)},
                "rollout": {"engine": "vllm", "continuous": True, "partial": True},
            }
        )
        await publish_config(await js.key_value(topology.kv_bucket), config)
        rt = await attach("rollout", topology.run, nats_server.url)
        rollout = Rollout(rt, engine, AutoTokenizer.from_pretrained(model_dir))
        assert rollout.copies.continuous and rollout.copies.partial
        stop = asyncio.Event()
        loop = asyncio.create_task(serve(rt, rollout_stage(rollout), stop))
        try:
            await js.publish(
                topology.subject(WEIGHTS), encode(await store_weights(js, topology, 0, old))
            )
            for index in range(count):
                event = PromptEvent(
                    id=f"{topology.run}/0/{index}",
                    run=topology.run,
                    epoch=0,
                    index=index,
                    token_ids=Tensor.from_numpy(np.array(PROMPTS_IDS[index], np.int32)),
                    n=group,
                    sampling=PromptSampling(temperature=TEMPERATURE, max_tokens=30),
                )
                await js.publish(topology.subject(PROMPTS), encode(event))
            deadline = time.monotonic() + 60
            while len(core.submitted) < count * group or not tokens_in(
                core, 4
            ):  # all started, all mid-way
                assert time.monotonic() < deadline and not loop.done(), (
                    f"samples not mid-way: {core.active}"
                )
                await asyncio.sleep(0.005)
            await js.publish(
                topology.subject(WEIGHTS), encode(await store_weights(js, topology, 1, new))
            )
            while (
                await js.stream_info(topology.stream(TRAJECTORIES))
            ).state.messages < count * group:
                assert time.monotonic() < deadline and not loop.done(), (
                    "trajectories not stored in 60 s"
                )
                await asyncio.sleep(0.05)
            sub = await js.subscribe(topology.subject(TRAJECTORIES), ordered_consumer=True)
            stored = [
                decode((await sub.next_msg(timeout=5)).data, TrajectoryEvent)
                for _ in range(count * group)
            ]
            await sub.unsubscribe()
            return stored
        finally:
            stop.set()
            await asyncio.gather(loop, return_exceptions=True)
            await rt.close()
            await topology.delete(js)
            await nc.close()

    try:
        stored = asyncio.run(main())
    finally:
        engine.close()
    assert core.violations == [] and core.loads == 1 and engine.version == 1, (
        core.violations,
        core.loads,
    )
    spanning = 0
    for t in stored:
        versions = torch.from_numpy(t.versions.numpy().astype(np.int64))
        assert versions.tolist() == sorted(versions.tolist()), (
            f"{t.id}: versions go back: {versions.tolist()}"
        )
        spanning += {0, 1} <= set(versions.tolist())
        prompt, response = t.prompt_ids.numpy().tolist(), t.response_ids.numpy().tolist()
        under_old = logprobs_under(trainer, old, prompt, response)
        under_new = logprobs_under(trainer, new, prompt, response)
        got = torch.from_numpy(t.logprobs.numpy().copy())
        torch.testing.assert_close(
            got,
            torch.where(versions == 1, under_new, under_old),
            atol=1e-5,
            rtol=0,
            msg=lambda m, t=t: f"{t.id}: {m}",  # type: ignore[misc]  # the default binds the loop
        )
    assert spanning, (
        f"no trajectory spanned v0 -> v1: {[t.versions.numpy().tolist() for t in stored]}"
    )
