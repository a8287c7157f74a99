"""The SGLang adapter on CPU, without SGLang: its request, its reading of recorded outputs, the
log-prob alignment with the trainer, and its weight load. The real engine:
tests/test_gpu_engines.py."""

from pathlib import Path
from typing import Any

import pytest
import torch

from engines.external_rollout import EngineUnavailable, named_weights, skeleton
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import SamplingParams
from engines.sglang_rollout import (
    ORIGINAL_LOGPROB_ENV,
    SGLangSettings,
    check_logprob_env,
    engine_kwargs,
    load_weights,
    output_to_sample,
    outputs_to_groups,
    sampling_params,
)
from tests.engine_records import (  # noqa: F401 - a fixture
    TEMPERATURE,
    as_plain,
    load,
    model_dir,
    sglang_report,
    trainer_logprobs,
)

API = load("engine_api.json")["sglang"]
STOP_IDS = (2, 7)  # the recorded fixture's eos and stop token


def test_the_request_uses_sglangs_field_names_and_our_sampling() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, stop_token_ids=(7, 2))
    request = sampling_params(params, eos=(2,))
    assert set(request) <= set(API["SamplingParams"]), set(request) - set(API["SamplingParams"])
    assert request == {
        "temperature": 0.7,
        "top_p": 0.9,
        "max_new_tokens": 12,
        "stop_token_ids": [2, 7],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    engine = engine_kwargs(
        Path("/m"), SGLangSettings(mem_fraction_static=0.3, tp_size=2, context_length=256)
    )
    assert set(engine) <= set(API["ServerArgs"]), set(engine) - set(API["ServerArgs"])
    assert (
        engine["model_path"],
        engine["mem_fraction_static"],
        engine["tp_size"],
        engine["context_length"],
        engine["skip_tokenizer_init"],
    ) == ("/m", 0.3, 2, 256, True)


def test_recorded_outputs_become_samples_grouped_per_prompt() -> None:
    recorded = load("sglang_generate_output.json")
    groups = outputs_to_groups(recorded["outputs"], prompts=2, n=2, stop_ids=STOP_IDS)
    assert as_plain(groups) == recorded["expected"]
    with pytest.raises(ValueError, match="4 outputs for 3 prompts x n=2"):
        outputs_to_groups(recorded["outputs"], prompts=3, n=2, stop_ids=STOP_IDS)


def _output(length: bool = False, **meta: Any) -> dict[str, Any]:
    outputs = load("sglang_generate_output.json")["outputs"]
    base = outputs[1] if length else outputs[0]  # [11, 12, 13] by length; [3, 4, 2] stopped by 2
    return {**base, "meta_info": {**base["meta_info"], **meta}}


@pytest.mark.parametrize(
    ("output", "error"),
    [
        (_output(finish_reason={"type": "abort", "message": "x"}), "finished by 'abort'"),
        (_output(finish_reason=None), "finished by None"),
        (
            _output(length=True, finish_reason={"type": "stop", "matched": 13}),
            "on token 13, not one of the stop ids",
        ),
        (_output(output_token_logprobs=None), "without meta_info.output_token_logprobs"),
        (
            {**_output(), "output_ids": [3, 4]},
            "output_ids and the tokens of output_token_logprobs differ",
        ),
        ({**_output(output_token_logprobs=[]), "output_ids": []}, "an empty response"),
    ],
)
def test_an_output_that_would_misalign_the_trainer_is_refused(
    output: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        output_to_sample(output, STOP_IDS)


def test_logprobs_as_sglang_reports_them_are_what_the_trainer_computes(model_dir: Path) -> None:  # noqa: F811
    """Our HF engine draws (with top_p < 1, which SGLang's log-probs ignore as ours do); its
    draws are written as SGLang reports them; the adapter's samples must carry the trainer's
    log-probs at the sampling temperature."""
    hf = HFRolloutEngine(model_dir, seed=4)
    prompts = [[5, 6, 9, 11], [12, 4], [8, 8, 8]]
    params = SamplingParams(
        temperature=TEMPERATURE, top_p=0.95, max_tokens=10, stop_token_ids=(13,)
    )
    drawn = hf.generate(prompts, 2, params)
    groups = outputs_to_groups(sglang_report(drawn), len(prompts), 2, (hf.eos_token_ids[0], 13))
    assert as_plain(groups) == as_plain(drawn)
    expected = trainer_logprobs(model_dir, prompts, groups)
    got = torch.cat([s.logprobs for g in groups for s in g])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_the_original_logprob_switch_is_refused() -> None:
    check_logprob_env({})
    check_logprob_env({ORIGINAL_LOGPROB_ENV: "false"})
    with pytest.raises(EngineUnavailable, match=f"{ORIGINAL_LOGPROB_ENV} is set"):
        check_logprob_env({ORIGINAL_LOGPROB_ENV: "True"})


class _Engine:
    """`sglang.Engine.update_weights_from_tensor(named_tensors, flush_cache)` over a real HF
    module: the model's loader copies each (HF name, tensor) into that parameter."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.flushed: list[Any] = []

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool = True
    ) -> None:
        params = dict(self.module.named_parameters())
        for name, tensor in named_tensors:
            assert tensor.dtype == params[name].dtype, name
            params[name].data.copy_(tensor)
        self.flushed.append(flush_cache)


def test_weights_reach_the_engine_by_hf_name_and_flush_its_cache(model_dir: Path) -> None:  # noqa: F811
    hf = HFRolloutEngine(model_dir, dtype=torch.bfloat16)
    engine = _Engine(hf.model)
    new = {
        name: torch.randn(p.shape) for name, p in hf.model.named_parameters()
    }  # float32, as the trainer sends
    load_weights(engine, named_weights(new, skeleton(model_dir), torch.bfloat16))
    assert engine.flushed == [True]
    for name, param in hf.model.named_parameters():
        assert torch.equal(param, new[name].to(torch.bfloat16)), name
