"""The vLLM adapter on CPU, without vLLM: its request, its reading of recorded outputs, the
log-prob alignment with the trainer, and its weight load (built by its own constructor over
`tests.engine_standins`, whose `vllm.LLM` refuses a function in `collective_rpc` without
VLLM_ALLOW_INSECURE_SERIALIZATION, as vLLM does, and counts the bytes of each RPC). The real
engine: tests/test_gpu_engines.py; the real package's encoder: tests/test_engine_contracts.py."""

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engines.external_rollout import EngineUnavailable, named_weights, skeleton, weight_buckets
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import SamplingParams
from engines.vllm_rollout import (
    INSECURE_SERIALIZATION_ENV,
    LOGPROBS_MODE,
    VLLMRolloutEngine,
    VLLMSettings,
    allow_function_rpc,
    completion_to_sample,
    llm_kwargs,
    load_on_worker,
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
from tests.engine_standins import HEADER_SLACK, StandInLLM, vllm_module

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


@pytest.fixture
def no_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_ALLOW_INSECURE_SERIALIZATION unset for the test (and as it was afterwards)."""
    monkeypatch.setenv(INSECURE_SERIALIZATION_ENV, "0")
    monkeypatch.delenv(INSECURE_SERIALIZATION_ENV)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import vllm` gives the stand-in module: `vllm.LLM` is a `StandInLLM`."""
    for name, module in vllm_module().items():
        monkeypatch.setitem(sys.modules, name, module)


def perturbed(model_dir: Path) -> dict[str, torch.Tensor]:  # noqa: F811
    """New weights for every parameter of the model, as the trainer exports them."""
    return {n: torch.randn(p.shape) for n, p in skeleton(model_dir).named_parameters()}


def test_the_stand_in_refuses_a_function_without_the_flag_as_vllm_does(
    no_flag: None,
    model_dir: Path,  # noqa: F811
) -> None:
    llm = StandInLLM(str(model_dir))
    with pytest.raises(TypeError, match="is not serializable"):
        llm.collective_rpc(load_on_worker, args=([],))
    os.environ[INSECURE_SERIALIZATION_ENV] = "1"  # too late: the engine core started without it
    with pytest.raises(NotImplementedError, match="Extension type code 2"):
        llm.collective_rpc(load_on_worker, args=([],))
    assert llm.rpc_bytes == []


def test_the_adapter_sets_the_flag_before_the_engine_starts_so_its_loader_travels(
    no_flag: None,
    fake_vllm: None,
    model_dir: Path,  # noqa: F811
) -> None:
    engine = VLLMRolloutEngine(model_dir)
    llm = engine.llm
    assert isinstance(llm, StandInLLM) and llm.engine_args["logprobs_mode"] == LOGPROBS_MODE
    new = perturbed(model_dir)
    engine.load_state_dict(new)
    assert llm.events == ["load", "reset prefix cache"] and engine.version == 1
    for name, param in llm.hf.model.named_parameters():
        assert torch.equal(param, new[name]), name


def test_the_flag_is_set_when_unset_and_refused_in_one_line_when_off() -> None:
    environ: dict[str, str] = {}
    allow_function_rpc(environ)
    assert environ == {INSECURE_SERIALIZATION_ENV: "1"}
    allow_function_rpc({INSECURE_SERIALIZATION_ENV: "1"})
    for off in ("0", "yes"):
        with pytest.raises(EngineUnavailable, match=f"{INSECURE_SERIALIZATION_ENV}='{off}'"):
            allow_function_rpc({INSECURE_SERIALIZATION_ENV: off})


def test_weights_are_cut_into_buckets_in_order_a_large_tensor_alone() -> None:
    sizes = [10, 10, 30, 4, 4, 4]  # float32 elements: 40, 40, 120, 16, 16, 16 bytes
    weights = [(f"w{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    buckets = weight_buckets(weights, 64)
    assert [[name for name, _ in b] for b in buckets] == [
        ["w0"],
        ["w1"],
        ["w2"],
        ["w3", "w4", "w5"],
    ]
    assert [len(b) for b in weight_buckets(weights, 10**9)] == [6]
    with pytest.raises(ValueError, match="at least 1 byte"):
        weight_buckets(weights, 0)


def test_a_version_goes_into_the_engine_in_rpcs_of_at_most_the_bucket_bytes(
    fake_vllm: None,
    model_dir: Path,  # noqa: F811
) -> None:
    bucket = 128 * 1024
    engine = VLLMRolloutEngine(model_dir, VLLMSettings(weight_bucket_bytes=bucket))
    llm = engine.llm
    new = perturbed(model_dir)
    total = sum(t.numel() * t.element_size() for t in new.values())
    engine.load_state_dict(new)
    sent = llm.rpc_bytes
    assert max(sent) <= bucket + HEADER_SLACK, sent
    assert total <= sum(sent) <= total + HEADER_SLACK * len(sent), (total, sent)
    assert len(sent) >= total / bucket > 2, (total, sent)
    assert llm.events == ["load"] * len(sent) + ["reset prefix cache"]
    for name, param in llm.hf.model.named_parameters():
        assert torch.equal(param, new[name]), name


def test_weights_reach_the_workers_model_by_hf_name_then_the_prefix_cache_is_dropped(
    model_dir: Path,  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(INSECURE_SERIALIZATION_ENV, "1")  # as the adapter sets it
    llm = StandInLLM(str(model_dir))
    new = {name: torch.randn_like(p) for name, p in llm.hf.model.named_parameters()}
    load_weights(llm, named_weights(new, skeleton(model_dir), torch.float32))
    assert llm.events == ["load", "reset prefix cache"]  # the cache goes after the weights
    assert llm.loader.calls == 1
    for name, param in llm.hf.model.named_parameters():
        assert torch.equal(param, new[name]), name


def test_the_engine_sleeps_and_loads_on_waking_a_version_that_came_while_asleep(
    fake_vllm: None,
    model_dir: Path,  # noqa: F811
) -> None:
    """Colocated (`VLLMSettings.sleep_mode`): `release_memory` is vLLM's ``sleep(level=1)``,
    `resume_memory` its ``wake_up()``; a version that arrives while asleep is not sent to the
    sleeping engine (the stand-in refuses a load into it, as its unmapped weights would) but
    loaded, bucket by bucket and read back, right after the wake."""
    engine = VLLMRolloutEngine(model_dir, VLLMSettings(sleep_mode=True))
    llm = engine.llm
    assert isinstance(llm, StandInLLM) and llm.engine_args["enable_sleep_mode"] is True
    weights = sum(p.numel() * 4 for p in skeleton(model_dir).parameters())  # float32
    assert engine.device_bytes() == weights
    engine.release_memory()
    engine.release_memory()  # asleep already: nothing more
    assert llm.events == ["sleep 1"] and engine.device_bytes() == 0
    with pytest.raises(RuntimeError, match="sleeps"):
        engine.generate([[5, 6]], 1, SamplingParams(max_tokens=2))
    with pytest.raises(KeyError, match="does not have"):
        engine.load_state_dict({"no.such.weight": torch.zeros(1)}, version=3)
    new = perturbed(model_dir)
    engine.load_state_dict(new, version=3)
    assert engine.version == 3 and llm.events == ["sleep 1"]
    engine.resume_memory()
    assert llm.events == ["sleep 1", "wake up", "load", "reset prefix cache"]
    for name, param in llm.hf.model.named_parameters():
        assert torch.equal(param, new[name]), name
    assert engine.device_bytes() == weights
    assert len(engine.generate([[5, 6]], 2, SamplingParams(max_tokens=2))[0]) == 2


def test_sleep_without_sleep_mode_is_refused_as_vllm_refuses_it(
    fake_vllm: None,
    model_dir: Path,  # noqa: F811
) -> None:
    engine = VLLMRolloutEngine(model_dir)  # separated: built without sleep mode
    assert engine.llm.engine_args["enable_sleep_mode"] is False
    with pytest.raises(AssertionError, match="Sleep mode is not enabled"):
        engine.release_memory()
