"""What the vLLM and SGLang adapters share, on CPU: the model skeleton, weights in HF names,
the config, and the refusal to start without the engine's package (in-process and as a worker)."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.runtime import publish_config
from bus.topology import Topology
from consumers.checks import ModelLimits
from engines.build import build_rollout_engine
from engines.external_rollout import EngineUnavailable, named_weights, require, skeleton
from engines.hf_rollout import HFRolloutEngine
from schemas.config import ConfigError, parse_config
from schemas.rollout_config import SGLangRolloutConfig, VLLMRolloutConfig
from tests.engine_records import model_dir  # noqa: F401 - a fixture

ROOT = Path(__file__).resolve().parent.parent
MISSING = [e for e in ("vllm", "sglang") if importlib.util.find_spec(e) is None]


def test_the_skeleton_has_the_models_names_and_shapes_and_no_memory(model_dir: Path) -> None:  # noqa: F811
    real = HFRolloutEngine(model_dir).model
    meta = skeleton(model_dir)
    assert {n: p.shape for n, p in meta.named_parameters()} == {
        n: p.shape for n, p in real.named_parameters()
    }
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert ModelLimits.of(meta) == ModelLimits.of(real)
    limits = ModelLimits.of(real)
    assert ModelLimits.of(skeleton(model_dir, context=16)) == ModelLimits(
        limits.vocab_size, 16
    )  # the engine's max_model_len
    assert (
        ModelLimits.of(skeleton(model_dir, context=10**6)) == limits
    )  # never above the model's own


def test_named_weights_cast_and_refuse_wrong_names_or_shapes(model_dir: Path) -> None:  # noqa: F811
    meta = skeleton(model_dir)
    tensors = {n: torch.randn(p.shape) for n, p in meta.named_parameters()}
    pairs = named_weights(tensors, meta, torch.bfloat16)
    assert [n for n, _ in pairs] == [n for n, _ in meta.named_parameters()]
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for _, t in pairs)
    assert all(torch.equal(t, tensors[n].to(torch.bfloat16)) for n, t in pairs)
    assert all(t is tensors[n] for n, t in named_weights(tensors, meta, None))  # "auto": no copy
    first = next(iter(tensors))
    # A subset goes in as it is (the tensors a version changed), in the model's order.
    names = [n for n, _ in meta.named_parameters()]
    subset = {n: tensors[n] for n in reversed(names[1::2])}
    assert [n for n, _ in named_weights(subset, meta, None)] == names[1::2]
    # A name the model does not have is refused, never dropped (an engine's loader may skip it).
    with pytest.raises(KeyError, match=r"does not have: \['bogus'\]"):
        named_weights(
            {**{n: t for n, t in tensors.items() if n != first}, "bogus": tensors[first]},
            meta,
            None,
        )
    with pytest.raises(ValueError, match=f"{first}: shape"):
        named_weights({**tensors, first: tensors[first][..., :1]}, meta, None)


def test_config_takes_the_engines_sections_and_refuses_top_p_below_1_on_vllm() -> None:
    cfg = parse_config(
        {
            "rollout": {
                "engine": {"type": "vllm", "gpu_memory_utilization": 0.3, "max_model_len": 512}
            }
        }
    )
    assert isinstance(cfg.rollout.engine, VLLMRolloutConfig)
    assert (cfg.rollout.engine.gpu_memory_utilization, cfg.rollout.engine.max_model_len) == (
        0.3,
        512,
    )
    sglang = parse_config({"rollout": {"engine": "sglang"}, "data": {"sampling": {"top_p": 0.9}}})
    assert (
        isinstance(sglang.rollout.engine, SGLangRolloutConfig)
        and sglang.rollout.engine.tp_size == 1
    )
    with pytest.raises(
        ConfigError, match="rollout.engine vllm needs data.sampling.top_p 1, not 0.9"
    ):
        parse_config({"rollout": {"engine": "vllm"}, "data": {"sampling": {"top_p": 0.9}}})
    with pytest.raises(
        ConfigError, match=r"rollout.engine.tp: Extra inputs are not permitted \(type sglang\)"
    ):
        parse_config({"rollout": {"engine": {"type": "sglang", "tp": 2}}})


def test_require_names_the_extra() -> None:
    with pytest.raises(EngineUnavailable) as refused:
        require("jetrl_no_such_engine", "vllm")
    assert "\n" not in str(refused.value)
    assert str(refused.value).endswith("install it with: pip install 'jetrl[vllm]'")


@pytest.mark.parametrize("engine", MISSING)
def test_an_engine_that_is_not_installed_is_refused_in_one_line(
    engine: str,
    model_dir: Path,  # noqa: F811 - the fixture imported above
) -> None:
    with pytest.raises(EngineUnavailable) as refused:
        build_rollout_engine(
            parse_config({"rollout": {"engine": engine}}).rollout.engine, model_dir, seed=0
        )
    message = str(refused.value)
    assert "\n" not in message and message.endswith(f"pip install 'jetrl[{engine}]'"), message


@pytest.mark.skipif("vllm" not in MISSING, reason="vllm is installed here")
def test_the_rollout_worker_refuses_to_start_without_the_engine(
    nats_server: EmbeddedNats,
    topology: Topology,
    model_dir: Path,  # noqa: F811
) -> None:
    async def setup() -> None:
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        await topology.apply(js)
        config = parse_config(
            {"run": topology.run, "rollout": {"engine": "vllm"}, "model": {"path": str(model_dir)}}
        )
        await publish_config(await js.key_value(topology.kv_bucket), config)
        await nc.close()

    asyncio.run(setup())
    worker = subprocess.run(
        [
            sys.executable,
            "-m",
            "consumers.rollout",
            "--run",
            topology.run,
            "--nats",
            nats_server.url,
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode == 1
    assert (
        worker.stderr.strip()
        .splitlines()[-1]
        .startswith("consumers.rollout: rollout.engine vllm needs the vllm package")
    )
    assert worker.stderr.strip().endswith("pip install 'jetrl[vllm]'")
