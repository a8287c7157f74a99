"""Issue 28 on CPU, engine by engine: a weight load takes any subset of the model's tensors
(those a version changed), refuses a name the model lacks, and reads each load back, raising
`WeightsNotLoaded` naming the bucket and the tensor when the engine does not hold what it was
sent. vLLM and SGLang run over the stand-ins of `tests.engine_standins` and the fakes of
`tests.continuous_fakes`, whose loaders can pass over a name without a word (as real loaders
pass over some) and whose vLLM transport can flip a byte of a bucket."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engines.external_rollout import named_weights, skeleton
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import WeightsNotLoaded
from engines.sglang_rollout import SGLangRolloutEngine, SGLangSettings
from engines.sglang_rollout import load_weights as sglang_load
from engines.vllm_rollout import VLLMRolloutEngine, VLLMSettings
from engines.vllm_rollout import load_weights as vllm_load
from schemas.config import ConfigError, parse_config
from schemas.rollout_config import SGLangRolloutConfig
from tests.continuous_fakes import FakeCore, adapter
from tests.engine_records import model_dir  # noqa: F401 - a fixture
from tests.engine_standins import HEADER_SLACK, StandInLLM, sglang_modules, vllm_module


def params_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def some(model_dir: Path, every: int = 3) -> dict[str, torch.Tensor]:  # noqa: F811
    """New values for every `every`-th parameter of the model: a version's changed tensors."""
    names = [n for n, _ in skeleton(model_dir).named_parameters()]
    shapes = dict(skeleton(model_dir).named_parameters())
    return {n: torch.randn(shapes[n].shape) for n in names[::every]}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_the_hf_engine_loads_a_subset_refuses_unknown_names_and_reads_each_tensor_back(
    model_dir: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = HFRolloutEngine(model_dir)
    before, new = params_of(engine.model), some(model_dir)
    engine.load_state_dict(new, version=3)
    after = params_of(engine.model)
    assert engine.version == 3
    assert all(torch.equal(after[n], new[n]) for n in new)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in new), "untouched"
    # An unknown name: refused before anything is copied.
    first = next(iter(new))
    with pytest.raises(KeyError, match="does not have"):
        engine.load_state_dict({first: torch.zeros_like(new[first]), "nope": torch.zeros(1)})
    assert torch.equal(dict(engine.model.named_parameters())[first], new[first])
    # A copy that loses a tensor (here: never written) is caught by the read-back.
    lost = list(new)[1]
    copy = engine._copy

    def losing(params: dict[str, torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
        copy({n: p for n, p in params.items() if n != lost}, tensors)

    monkeypatch.setattr(engine, "_copy", losing)
    with pytest.raises(WeightsNotLoaded, match=f"hf: {lost} does not read back"):
        engine.load_state_dict({n: t + 1 for n, t in new.items()}, version=4)
    assert engine.version == 3, "a load that did not read back set the version"


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, module in vllm_module().items():
        monkeypatch.setitem(sys.modules, name, module)


def test_vllm_gets_only_the_tensors_sent_and_checks_every_bucket(
    fake_vllm: None,
    model_dir: Path,  # noqa: F811
) -> None:
    bucket = 64 * 1024
    engine = VLLMRolloutEngine(model_dir, VLLMSettings(weight_bucket_bytes=bucket))
    llm = engine.llm
    assert isinstance(llm, StandInLLM)
    before, new = params_of(llm.hf.model), some(model_dir)
    engine.load_state_dict(new, version=1)
    sent = llm.rpc_bytes
    assert nbytes(new) <= sum(sent) <= nbytes(new) + HEADER_SLACK * len(sent), (nbytes(new), sent)
    after = params_of(llm.hf.model)
    assert all(torch.equal(after[n], new[n]) for n in new)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in new)
    # Each worker read back every tensor that has its HF name (all of them, on the stand-in).
    pairs = named_weights(new, engine.model, None)
    assert vllm_load(llm, pairs, bucket) == set(new)
    # A loader that passes over a name: the read-back names the bucket and the tensor.
    skipped = list(new)[-1]
    llm.loader.skip = {skipped}
    with pytest.raises(WeightsNotLoaded, match=rf"vllm: bucket \d+ .*reads back {skipped} "):
        engine.load_state_dict({n: t + 1 for n, t in new.items()}, version=2)
    assert engine.version == 1
    # A bucket changed on the way: refused by its sha256, and not loaded.
    llm.loader.skip, llm.corrupt = set(), True
    held = params_of(llm.hf.model)
    with pytest.raises(WeightsNotLoaded, match=r"vllm: bucket 0 .*received bytes of sha256"):
        engine.load_state_dict({n: t + 2 for n, t in new.items()}, version=3)
    assert all(torch.equal(p, held[n]) for n, p in params_of(llm.hf.model).items())


def test_sglang_takes_a_version_in_checked_buckets_the_cache_flushed_with_the_last(
    model_dir: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, module in sglang_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    bucket = 128 * 1024
    adapter_ = SGLangRolloutEngine(model_dir, SGLangSettings(weight_bucket_bytes=bucket))
    engine = adapter_.engine
    new = {n: torch.randn(p.shape) for n, p in skeleton(model_dir).named_parameters()}
    adapter_.load_state_dict(new, version=1)
    sizes = [nbytes({n: new[n] for n in names}) for names in engine.updates]
    assert len(sizes) > 2 and all(
        s <= bucket or len(u) == 1 for s, u in zip(sizes, engine.updates, strict=True)
    )
    assert [n for names in engine.updates for n in names] == list(new), "each tensor once, in order"
    assert engine.flushed == [False] * (len(sizes) - 1) + [True]
    assert all(torch.equal(p, new[n]) for n, p in engine.hf.model.named_parameters())
    # Only what is sent goes in: a subset, one bucket.
    engine.updates.clear()
    subset = some(model_dir, every=7)
    sglang_load(engine, named_weights(subset, adapter_.model, None), 2**30)
    assert engine.updates == [list(subset)]
    # A loader that passes over the first tensor of a bucket while answering success.
    engine.updates.clear()
    skipped = list(new)[3]
    engine.skip = {skipped}
    pairs = named_weights({n: t + 1 for n, t in new.items()}, adapter_.model, None)
    with pytest.raises(WeightsNotLoaded, match=rf"sglang: bucket 1: {skipped}'s first row"):
        sglang_load(engine, pairs, nbytes(dict(pairs[:3])))
    # A load SGLang answers as failed names its bucket.
    engine.skip, engine.refuse_loads = set(), True
    with pytest.raises(WeightsNotLoaded, match=r"sglang: bucket 0 \(.*\): update_weights_from"):
        adapter_.load_state_dict(new, version=2)
    assert adapter_.version == 1
    adapter_.close()


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_the_continuous_adapters_load_a_subset_and_catch_a_tensor_not_loaded(
    kind: str,
    model_dir: Path,  # noqa: F811
) -> None:
    core = FakeCore(model_dir)
    engine = adapter(kind, model_dir, core, bucket_bytes=64 * 1024)
    try:
        before, new = params_of(core.hf), some(model_dir)
        engine.load_state_dict(new, version=1)
        after = params_of(core.hf)
        assert all(torch.equal(after[n], new[n]) for n in new)
        assert all(torch.equal(after[n], before[n]) for n in before if n not in new)
        if kind == "sglang":
            flushed = engine.engine.tokenizer_manager.flushed  # type: ignore[attr-defined]
            assert flushed[-1] and not any(flushed[:-1]) and len(flushed) > 1, flushed
        core.skip = {next(iter(new))}  # the first tensor of the first bucket
        with pytest.raises(WeightsNotLoaded, match=f"{kind}: bucket 0"):
            engine.load_state_dict({n: t + 1 for n, t in new.items()}, version=2)
        assert engine.version == 1
    finally:
        engine.close()


def test_the_sglang_continuous_adapter_loads_each_bucket_in_a_session_closed_on_failure(
    model_dir: Path,  # noqa: F811
) -> None:
    """SGLang 0.5.23 refuses an update outside a weight-update session (the fake, as the real
    scheduler, `tests.test_engine_contracts`): each bucket loads inside one, and a load that
    fails, answered or raised, still closes it (else every later begin is refused)."""
    core = FakeCore(model_dir)
    engine = adapter("sglang", model_dir, core, bucket_bytes=64 * 1024)
    manager = engine.engine.tokenizer_manager  # type: ignore[attr-defined]
    new = some(model_dir)
    try:
        engine.load_state_dict(new, version=1)
        buckets = len(manager.flushed)
        assert buckets > 1 and manager.steps == ["begin", "update", "end"] * buckets
        assert not manager.session and engine.version == 1
        manager.steps.clear()
        manager.refuse_loads = True
        with pytest.raises(WeightsNotLoaded, match=r"sglang: bucket 0 .*: shape mismatch"):
            engine.load_state_dict(new, version=2)
        assert manager.steps == ["begin", "update", "end"] and not manager.session
        manager.steps.clear()
        manager.refuse_loads = False
        answer = manager.update_weights_from_tensor

        async def broken(request: object, http: None) -> tuple[bool, str]:
            manager.steps.append("update")
            raise ConnectionError("the scheduler went away")

        manager.update_weights_from_tensor = broken
        with pytest.raises(ConnectionError, match="went away"):
            engine.load_state_dict(new, version=3)
        assert manager.steps == ["begin", "update", "end"] and not manager.session
        manager.update_weights_from_tensor = answer
        engine.load_state_dict({n: t + 1 for n, t in new.items()}, version=4)
        assert engine.version == 4 and not manager.session
        assert all(torch.equal(dict(core.hf.named_parameters())[n], t + 1) for n, t in new.items())
    finally:
        engine.close()


def test_the_sglang_section_has_a_weight_bucket_size_checked_at_load() -> None:
    sglang = parse_config({"rollout": {"engine": "sglang"}}).rollout.engine
    assert isinstance(sglang, SGLangRolloutConfig) and sglang.weight_bucket_bytes == 512 * 2**20
    with pytest.raises(ConfigError, match="rollout.engine.weight_bucket_bytes"):
        parse_config({"rollout": {"engine": {"type": "sglang", "weight_bucket_bytes": 0}}})
