"""The vLLM adapter on CPU, without vLLM: its request, its reading of recorded outputs, the
log-prob alignment with the trainer, and its weight load. The real engine:
tests/test_gpu_engines.py."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engines.external_rollout import named_weights, skeleton
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import SamplingParams
from engines.vllm_rollout import (
    LOGPROBS_MODE,
    VLLMSettings,
    completion_to_sample,
    llm_kwargs,
    load_weights,
    request_to_samples,
    sampling_kwargs,
)
from tests.engine_records import (  # noqa: F401 - a fixture
    TEMPERATURE,
    as_plain,
    load,
    model_dir,
    trainer_logprobs,
    vllm_objects,
    vllm_report,
)

API = load("engine_api.json")["vllm"]
STOP_IDS = (2, 7)  # the recorded fixture's eos and stop token


def test_the_request_uses_vllms_field_names_and_our_sampling() -> None:
    params = SamplingParams(temperature=0.7, top_p=1.0, max_tokens=12, stop_token_ids=(7, 2))
    kwargs = sampling_kwargs(params, n=4, eos=(2,), seed=5)
    assert set(kwargs) <= set(API["SamplingParams"]), set(kwargs) - set(API["SamplingParams"])
    assert kwargs == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 1.0,
        "max_tokens": 12,
        "stop_token_ids": [2, 7],
        "logprobs": 0,
        "detokenize": False,
        "seed": 5,
    }
    assert "seed" not in sampling_kwargs(params, n=1, eos=(2,))
    engine = llm_kwargs(
        Path("/m"), VLLMSettings(gpu_memory_utilization=0.3, max_model_len=256, enforce_eager=True)
    )
    assert set(engine) <= set(API["EngineArgs"]), set(engine) - set(API["EngineArgs"])
    assert LOGPROBS_MODE in API["logprobs_mode"]
    assert engine["logprobs_mode"] == "processed_logprobs"
    assert (
        engine["model"],
        engine["gpu_memory_utilization"],
        engine["max_model_len"],
        engine["enforce_eager"],
    ) == ("/m", 0.3, 256, True)


def test_top_p_below_1_and_n_0_are_refused() -> None:
    with pytest.raises(ValueError, match="needs top_p 1"):
        sampling_kwargs(SamplingParams(top_p=0.9), n=1, eos=(2,))
    with pytest.raises(ValueError, match="n must be at least 1"):
        sampling_kwargs(SamplingParams(), n=0, eos=(2,))


def test_recorded_request_outputs_become_samples_in_index_order() -> None:
    recorded = load("vllm_request_output.json")
    groups = [request_to_samples(r, 2, STOP_IDS) for r in vllm_objects(recorded["request_outputs"])]
    assert as_plain(groups) == recorded["expected"]
    assert all(
        s.token_ids.dtype == torch.long and s.logprobs.dtype == torch.float32
        for g in groups
        for s in g
    )


def _completion(**change: Any) -> SimpleNamespace:
    outputs = vllm_objects(load("vllm_request_output.json")["request_outputs"])[0].outputs
    base = (
        outputs[0] if change.pop("length", False) else outputs[1]
    )  # [11, 12, 13] by length; [3, 4, 2] stopped by 2
    return SimpleNamespace(**{**vars(base), **change})


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"finish_reason": "abort"}, "finished by 'abort'"),
        ({"finish_reason": None}, "finished by None"),
        ({"length": True, "finish_reason": "stop"}, "on token 13, not one of the stop ids"),
        ({"logprobs": None}, "without log-probs"),
        ({"token_ids": [3, 9, 2]}, "no log-prob for its sampled token 9"),
        ({"token_ids": [3, 4]}, "2 tokens but 3 log-probs"),
    ],
)
def test_a_completion_that_would_misalign_the_trainer_is_refused(
    change: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        completion_to_sample(_completion(**change), STOP_IDS)


def test_a_request_with_fewer_completions_than_n_is_refused() -> None:
    request = vllm_objects(load("vllm_request_output.json")["request_outputs"])[0]
    with pytest.raises(ValueError, match="2 completions for a request of n=3"):
        request_to_samples(request, 3, STOP_IDS)


def test_logprobs_as_vllm_reports_them_are_what_the_trainer_computes(model_dir: Path) -> None:  # noqa: F811
    """Our HF engine draws; its draws are written as vLLM's processed log-probs would report
    them; the adapter's samples must carry the trainer's log-probs at the sampling temperature."""
    hf = HFRolloutEngine(model_dir, seed=3)
    prompts = [[5, 6, 9, 11], [12, 4], [8, 8, 8]]
    stop = (hf.eos_token_ids[0], 13)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=10, stop_token_ids=(13,))
    drawn = hf.generate(prompts, 2, params)
    requests = vllm_objects(vllm_report(prompts, drawn))
    groups = [request_to_samples(r, 2, stop) for r in requests]
    assert as_plain(groups) == as_plain(drawn)
    expected = trainer_logprobs(model_dir, prompts, groups)
    got = torch.cat([s.logprobs for g in groups for s in g])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


class _Loader:
    """vLLM's `model.load_weights(weights=iterable)` contract over a real HF module: copies
    each (HF name, tensor) it is handed into the parameter of that name."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.calls = module, 0

    def load_weights(self, weights: Any) -> set[str]:
        self.calls += 1
        params = dict(self.module.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


class _LLM:
    """`vllm.LLM`'s `collective_rpc(callable, args)` (the callable gets each worker first) and
    `reset_prefix_cache`, over one in-process worker."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=_Loader(module)))
        self.events: list[str] = []

    def collective_rpc(self, method: Any, args: tuple[Any, ...] = ()) -> list[Any]:
        self.events.append("rpc")
        return [method(self.worker, *args)]

    def reset_prefix_cache(self) -> bool:
        self.events.append("reset")
        return True


def test_weights_reach_the_workers_model_by_hf_name_then_the_prefix_cache_is_dropped(
    model_dir: Path,  # noqa: F811 - the fixture imported above
) -> None:
    hf = HFRolloutEngine(model_dir)
    llm = _LLM(hf.model)
    new = {name: torch.randn_like(p) for name, p in hf.model.named_parameters()}
    load_weights(llm, named_weights(new, skeleton(model_dir), torch.float32))
    assert llm.events == ["rpc", "reset"]  # the cache goes after the weights changed, not before
    assert llm.worker.model_runner.model.calls == 1
    for name, param in hf.model.named_parameters():
        assert torch.equal(param, new[name]), name
