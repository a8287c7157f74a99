"""The SGLang adapter on CPU, without SGLang: its request, its reading of recorded outputs, the
log-prob alignment with the trainer, its weight load, the thread it builds and drives the
engine on (over `tests.engine_standins`, whose `sglang.Engine` binds the event loop where
SGLang binds it and runs it as SGLang does) and its version floor. The real engine:
tests/test_gpu_engines.py; the real package's loop binding: tests/test_engine_contracts.py."""

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.external_rollout import EngineUnavailable, named_weights, release, skeleton
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import Sample, SamplingParams
from engines.sglang_continuous import SGLangContinuousEngine
from engines.sglang_rollout import (
    ORIGINAL_LOGPROB_ENV,
    SGLANG_FLOOR,
    SGLangRolloutEngine,
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
from tests.engine_standins import StandInSGLangEngine, sglang_modules

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


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import sglang` gives the stand-in module: `sglang.Engine` is a `StandInSGLangEngine`."""
    for name, module in sglang_modules().items():
        monkeypatch.setitem(sys.modules, name, module)


PARAMS = SamplingParams(temperature=TEMPERATURE, max_tokens=6)


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited")  # as with SGLang
def test_the_stand_in_fails_as_sglang_does_when_driven_off_the_loop_it_bound(
    model_dir: Path,  # noqa: F811
) -> None:
    async def worker() -> None:
        engine = StandInSGLangEngine(str(model_dir))  # binds the worker's running loop
        assert engine.loop is asyncio.get_running_loop()
        with pytest.raises(RuntimeError, match="already running"):
            await asyncio.to_thread(engine.generate, [[5, 6]], sampling_params(PARAMS, (2,)), True)

    asyncio.run(worker())


def test_the_adapter_builds_and_drives_sglang_on_a_thread_of_its_own(
    fake_sglang: None,
    model_dir: Path,  # noqa: F811
) -> None:
    """As the rollout worker does: the engine built inside the worker's running loop, then
    `generate` and `load_state_dict` called through `asyncio.to_thread`."""
    new = {n: torch.randn(p.shape) for n, p in skeleton(model_dir).named_parameters()}

    async def worker() -> tuple[list[list[Sample]], StandInSGLangEngine]:
        adapter = SGLangRolloutEngine(model_dir)
        assert adapter.engine.loop is not asyncio.get_running_loop()
        groups = await asyncio.to_thread(adapter.generate, [[5, 6, 9], [12, 4]], 2, PARAMS)
        await asyncio.to_thread(adapter.load_state_dict, new)
        adapter.close()
        return groups, adapter.engine

    groups, engine = asyncio.run(worker())
    assert [len(g) for g in groups] == [2, 2] and engine.flushed == [True]
    assert (engine.shut_down_on or "").startswith("sglang-engine"), engine.shut_down_on
    for name, param in engine.hf.model.named_parameters():
        assert torch.equal(param, new[name]), name


@pytest.mark.parametrize("adapter", [SGLangRolloutEngine, SGLangContinuousEngine])
def test_an_sglang_below_the_floor_is_refused_in_one_line(
    adapter: Any,
    monkeypatch: pytest.MonkeyPatch,
    model_dir: Path,  # noqa: F811
) -> None:
    for name, module in sglang_modules(version="0.5.9").items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(EngineUnavailable) as refused:
        adapter(model_dir)
    message = str(refused.value)
    assert f"needs sglang >= {SGLANG_FLOOR}, not 0.5.9" in message and "\n" not in message
    assert release("0.5.10.post1") == (0, 5, 10) > release("0.5.9rc1") == (0, 5, 9)


def test_weights_reach_the_engine_by_hf_name_and_flush_its_cache(model_dir: Path) -> None:  # noqa: F811
    engine = StandInSGLangEngine(str(model_dir), dtype="bfloat16")
    new = {
        name: torch.randn(p.shape) for name, p in engine.hf.model.named_parameters()
    }  # float32, as the trainer sends
    load_weights(engine, named_weights(new, skeleton(model_dir), torch.bfloat16))
    assert engine.flushed == [True]
    for name, param in engine.hf.model.named_parameters():
        assert torch.equal(param, new[name].to(torch.bfloat16)), name


def test_a_load_sglang_reports_as_failed_is_an_error(model_dir: Path) -> None:  # noqa: F811
    engine = StandInSGLangEngine(str(model_dir))
    engine.refuse_loads = True
    new = {name: torch.randn(p.shape) for name, p in engine.hf.model.named_parameters()}
    with pytest.raises(RuntimeError, match="update_weights_from_tensor failed: Failed to update"):
        load_weights(engine, named_weights(new, skeleton(model_dir), None))


def test_the_engine_releases_its_memory_and_loads_on_resume_a_version_that_came_meanwhile(
    fake_sglang: None,
    model_dir: Path,  # noqa: F811
) -> None:
    """Colocated (`SGLangSettings.memory_saver`): `release_memory` is SGLang's
    ``release_memory_occupation()``, `resume_memory` its ``resume_memory_occupation()``, both
    on the engine's own thread; a version that arrives while released is not sent to the
    engine (the stand-in refuses an update into released memory) but loaded, checked, right
    after the resume."""
    adapter = SGLangRolloutEngine(model_dir, SGLangSettings(memory_saver=True))
    engine = adapter.engine
    assert isinstance(engine, StandInSGLangEngine)
    assert engine.server_args["enable_memory_saver"] is True
    weights = sum(p.numel() * 4 for p in skeleton(model_dir).parameters())  # float32
    assert adapter.device_bytes() == weights
    adapter.release_memory()
    adapter.release_memory()  # released already: nothing more
    assert engine.occupation == ["release"] and adapter.device_bytes() == 0
    with pytest.raises(RuntimeError, match="released"):
        adapter.generate([[5, 6]], 1, PARAMS)
    new = {n: torch.randn(p.shape) for n, p in skeleton(model_dir).named_parameters()}
    adapter.load_state_dict(new, version=5)
    assert adapter.version == 5 and engine.updates == []
    adapter.resume_memory()
    assert engine.occupation == ["release", "resume"] and engine.flushed == [True]
    for name, param in engine.hf.model.named_parameters():
        assert torch.equal(param, new[name]), name
    assert [len(g) for g in adapter.generate([[5, 6]], 2, PARAMS)] == [2]
    adapter.close()
