"""vLLM and SGLang for real: generate, log-probs against the trainer's, weights loaded into the
running engine (`ops.gpu.external.check`); the continuous adapters through a pause / load /
resume (`ops.gpu.external.check_continuous`). Each skips, with the reason, without its package
or CUDA."""

from pathlib import Path

import pytest
import torch

from engines.tiny import build_tiny_model
from ops.gpu.external import ENGINES, check, check_continuous, verdict, verdict_continuous
from producers.tasks import VOCAB


@pytest.mark.parametrize("name", ENGINES)
def test_engine_matches_the_trainer_before_and_after_a_weight_load(
    name: str, tmp_path: Path
) -> None:
    pytest.importorskip(name, reason=f"{name} is not installed: pip install 'jetrl[{name}]'")
    if not torch.cuda.is_available():
        pytest.skip(f"{name} needs a CUDA GPU (torch {torch.__version__} sees none)")
    # head_dim 64 and a 256-token context: shapes every attention backend of both engines takes.
    model_dir = build_tiny_model(
        tmp_path / "model", VOCAB, hidden=256, heads=4, kv_heads=2, max_positions=256
    )
    report = check(name, model_dir)
    assert verdict(report) == [], report


@pytest.mark.parametrize("mode", ["resubmit", "keep"])
@pytest.mark.parametrize("name", ENGINES)
def test_continuous_adapter_interrupts_loads_and_tags_every_token(
    name: str, mode: str, tmp_path: Path
) -> None:
    """Partial rollout on the real engine (`ops.gpu.external.check_continuous`)."""
    pytest.importorskip(name, reason=f"{name} is not installed: pip install 'jetrl[{name}]'")
    if not torch.cuda.is_available():
        pytest.skip(f"{name} needs a CUDA GPU (torch {torch.__version__} sees none)")
    model_dir = build_tiny_model(
        tmp_path / "model", VOCAB, hidden=256, heads=4, kv_heads=2, max_positions=256
    )
    report = check_continuous(name, model_dir, mode)
    assert verdict_continuous(report) == [], report
