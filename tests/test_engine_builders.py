"""Engines behind builders: the config's engine sections (a discriminated union), the builders
that turn a section into the protocol a stage calls, and stages that name no engine class."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engines.build import build_rollout_engines, build_train_engine
from engines.protocols import (
    ContinuousEngine,
    ReleasableEngine,
    RolloutEngine,
    SamplingParams,
    ShardedTrainEngine,
    TrainEngine,
)
from engines.torch_train import LossConfig
from schemas.config import ConfigError, RunConfig, parse_config

ROOT = Path(__file__).resolve().parent.parent


def test_a_bare_engine_type_is_its_section_with_the_defaults() -> None:
    for side, kind in [
        ("rollout", "vllm"),
        ("rollout", "simulated"),
        ("trainer", "fsdp"),
        ("trainer", "megatron"),
    ]:
        bare = parse_config({side: {"engine": kind}})
        full = parse_config({side: {"engine": {"type": kind}}})
        assert bare == full and getattr(bare, side).engine.type == kind
    default = parse_config({})
    assert (default.rollout.engine.type, default.trainer.engine.type) == ("hf", "torch")


def test_each_section_holds_its_engines_settings_only_and_says_which_key_is_wrong() -> None:
    cfg = parse_config(
        {
            "rollout": {"engine": {"type": "sglang", "tp_size": 2, "slots": 8}},
            "trainer": {"engine": {"type": "megatron", "pipeline_parallel_size": 2}},
        }
    )
    sglang = cfg.rollout.engine
    assert (sglang.tp_size, sglang.slots) == (2, 8)  # type: ignore[union-attr]
    assert (cfg.trainer.copy_size, cfg.trainer.ranks) == (2, 2)
    refused = {
        "config: rollout.engine.max_model_len: Extra inputs are not permitted (type sglang)": {
            "rollout": {"engine": {"type": "sglang", "max_model_len": 512}}
        },
        "config: rollout.engine.slots: Extra inputs are not permitted (type hf)": {
            "rollout": {"engine": {"type": "hf", "slots": 3}}
        },
        "config: trainer.engine.tensor_parallel_size: Extra inputs are not permitted (type fsdp)": {
            "trainer": {"engine": {"type": "fsdp", "tensor_parallel_size": 2}}
        },
        (
            "config: rollout.engine: an engine section names its engine in `type` "
            "(e.g. `type: vllm`)"
        ): {"rollout": {"engine": {"gpu_memory_utilization": 0.3}}},
        "config: rollout.vllm: Extra inputs are not permitted":  # the old sibling section
        {"rollout": {"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.3}}},
    }
    for message, data in refused.items():
        with pytest.raises(ConfigError) as error:
            parse_config(data)
        assert str(error.value) == message


def test_the_config_a_worker_reads_back_is_the_one_stored() -> None:
    """`bus.runtime` stores `model_dump(mode="json")` in KV; every worker parses it again."""
    cfg = parse_config(
        {
            "rollout": {"engine": {"type": "vllm", "max_model_len": 512, "slots": 4}},
            "trainer": {"engine": {"type": "megatron", "tensor_parallel_size": 2}},
        }
    )
    assert parse_config(cfg.model_dump(mode="json")) == cfg
    # mode sync validates again the sections it is given: an engine section whose type was
    # left at its default too.
    from schemas.trainer_config import FSDPEngineConfig, TrainerConfig

    given = TrainerConfig(engine=FSDPEngineConfig())
    assert RunConfig(mode="sync", trainer=given).trainer.engine.type == "fsdp"


def test_the_rollout_builder_makes_replicas_as_the_protocol_seeded_apart(model_dir: Path) -> None:
    section = {"type": "simulated", "slots": 3, "median_tokens": 4, "seconds_per_token": 0.0}
    settings = parse_config({"rollout": {"engine": section}})
    engines = build_rollout_engines(
        settings.rollout.engine, model_dir, 3, seed=5, dtype="float32", continuous=True
    )
    assert len(engines) == 3
    assert all(isinstance(e, ContinuousEngine) and e.slots == 3 for e in engines)
    drawn = [e.generate([[1, 2]], 4, SamplingParams(max_tokens=16)) for e in engines]
    samples = [tuple(tuple(s.token_ids.tolist()) for s in d[0]) for d in drawn]
    assert len(set(samples)) == 3, f"replicas drew the same samples: {samples}"
    hf = build_rollout_engines(
        parse_config({}).rollout.engine, model_dir, 2, seed=0, dtype="float32", continuous=True
    )
    assert all(isinstance(e, RolloutEngine) and not isinstance(e, ContinuousEngine) for e in hf)


def test_the_train_builder_makes_the_engine_its_section_names(model_dir: Path) -> None:
    cfg = parse_config({})
    engine = build_train_engine(
        cfg.trainer.engine, model_dir, lr=1e-3, loss=LossConfig(), device=torch.device("cpu")
    )
    assert isinstance(engine, TrainEngine) and engine.name == "torch"
    assert not isinstance(engine, ShardedTrainEngine)  # no rank exports a shard of its own
    vocab, context = engine.token_limits()
    assert vocab == engine.model.get_input_embeddings().num_embeddings  # type: ignore[attr-defined]
    assert context == engine.model.config.max_position_embeddings  # type: ignore[attr-defined]


def engine_classes() -> set[str]:
    """The engine classes `engines.build` builds (what it imports inside its builders)."""
    tree = ast.parse((ROOT / "engines" / "build.py").read_text())
    return {
        alias.name
        for function in tree.body
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.endswith("Engine")
    }


def test_no_stage_names_an_engine_class() -> None:
    classes = engine_classes()
    some = {"HFRolloutEngine", "VLLMContinuousEngine", "FSDPTrainEngine", "MegatronTrainEngine"}
    assert some <= classes
    named = []
    for path in sorted((ROOT / "consumers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engines"):
                where = path.relative_to(ROOT)
                named += [f"{where}: {alias.name}" for alias in node.names if alias.name in classes]
            elif isinstance(node, ast.Name | ast.Attribute):
                name = node.id if isinstance(node, ast.Name) else node.attr
                if name in classes:
                    named.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not named, f"stages name engine classes (build them with engines.build): {named}"


def test_a_colocated_run_builds_engines_that_can_give_their_memory_back(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`releasable` (the rollout worker passes it when `placement: colocated`): vllm built with
    sleep mode, sglang with its memory saver, which their release calls need; every engine
    built is a `ReleasableEngine`. Not releasable: built as before, neither flag on."""
    import sys

    from tests.engine_standins import sglang_modules, vllm_module

    for name, module in {**vllm_module(), **sglang_modules()}.items():
        monkeypatch.setitem(sys.modules, name, module)
    flags = {"vllm": "enable_sleep_mode", "sglang": "enable_memory_saver"}
    for kind in ("hf", "simulated", "vllm", "sglang"):
        section = parse_config({"rollout": {"engine": kind}}).rollout.engine
        for releasable in (True, False):
            (engine,) = build_rollout_engines(
                section, model_dir, 1, seed=0, dtype="float32", continuous=False,
                releasable=releasable,
            )  # fmt: skip
            assert isinstance(engine, ReleasableEngine), kind
            if kind == "vllm":
                assert engine.llm.engine_args[flags[kind]] is releasable  # type: ignore[attr-defined]
            if kind == "sglang":
                assert engine.engine.server_args[flags[kind]] is releasable  # type: ignore[attr-defined]
            close = getattr(engine, "close", None)
            if close is not None:
                close()
