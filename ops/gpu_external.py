"""The vLLM and SGLang adapters against the trainer, on a GPU: the `external` section of
`ops.gpu_check` and the body of tests/test_gpu_engines.py.

One check per engine: generate n samples per prompt at a temperature that is not 1; the
trainer (`TorchTrainEngine`, same weights, same temperature) recomputes every response
token's log-prob; then new weights go into the running engine (`load_state_dict`) and into
the trainer, and the comparison is repeated -- against the old weights too, which must now
disagree, or the load did nothing.
"""

from __future__ import annotations

import gc
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engines.protocols import RolloutEngine, Sample, SamplingParams
from engines.torch_train import LossConfig, TorchTrainEngine

ENGINES = ("vllm", "sglang")
TEMPERATURE = 0.7
TOLERANCE = {"float32": (2e-2, 2e-3), "bfloat16": (0.25, 0.03)}
"""dtype -> (max, mean) |engine - trainer| log-prob: what different kernels may differ by.
A missed temperature at 0.7 is off by ~|logprob| * 0.4, far above the mean bound."""


def installed() -> list[str]:
    return [name for name in ENGINES if importlib.util.find_spec(name) is not None]


def response_logprobs(trainer: TorchTrainEngine, prompts: list[list[int]], groups: list[list[Sample]]) -> torch.Tensor:
    """[sum of response lengths] the trainer's log-prob of every response token, in the order
    of `groups`' samples (rows prompt + response, right-padded)."""
    rows = [(prompt, s.token_ids.tolist()) for prompt, group in zip(prompts, groups, strict=True) for s in group]
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (prompt, response) in enumerate(rows):
        ids[i, : len(prompt) + len(response)] = torch.tensor(prompt + response)
        mask[i, : len(prompt) + len(response)] = 1
    logprobs = trainer.logprobs(ids, mask)  # [B, T]
    return torch.cat([logprobs[i, len(p) : len(p) + len(r)] for i, (p, r) in enumerate(rows)])


def make(name: str, model_dir: Path, dtype: str) -> RolloutEngine:
    """The adapter `name` with a small memory share, eager, a short context."""
    if name == "vllm":
        from engines.vllm_rollout import VLLMRolloutEngine, VLLMSettings

        return VLLMRolloutEngine(model_dir, VLLMSettings(gpu_memory_utilization=0.25, max_model_len=256, enforce_eager=True, dtype=dtype))
    from engines.sglang_rollout import SGLangRolloutEngine, SGLangSettings

    return SGLangRolloutEngine(model_dir, SGLangSettings(mem_fraction_static=0.25, context_length=256, dtype=dtype))


def close(engine: Any) -> None:
    """Frees the engine's GPU memory before the next one starts."""
    if hasattr(engine, "engine"):  # sglang.Engine runs a scheduler process
        engine.engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def _diff(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    err = (got - want).abs()
    return {"max": round(err.max().item(), 5), "mean": round(err.mean().item(), 6)}


def check(name: str, model_dir: Path, dtype: str = "float32", put: Callable[[str, Any], None] | None = None) -> dict[str, Any]:
    """Runs the check on engine `name`; returns (and `put`s as it goes) its figures."""
    report: dict[str, Any] = {"dtype": dtype}
    record = put or (lambda key, value: None)
    started = time.monotonic()
    engine = make(name, model_dir, dtype)
    report["start_s"] = round(time.monotonic() - started, 1)
    trainer = TorchTrainEngine(model_dir, lr=1e-3, loss=LossConfig(temperature=TEMPERATURE), device="cuda")
    gen = torch.Generator().manual_seed(0)
    vocab = trainer.model.get_input_embeddings().num_embeddings
    prompts = torch.randint(1, vocab - 1, (8, 12), generator=gen).tolist()
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=32)
    try:
        t0 = time.monotonic()
        groups = engine.generate(prompts, 4, params)
        seconds = time.monotonic() - t0
        tokens = sum(len(s.token_ids) for g in groups for s in g)
        report["generate"] = {"samples": sum(map(len, groups)), "tokens": tokens, "seconds": round(seconds, 3)}
        got = torch.cat([s.logprobs for g in groups for s in g])
        report["logprob_diff"] = _diff(got, response_logprobs(trainer, prompts, groups))
        record(name, report)

        old = trainer.export_weights()
        new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in old.items()}
        t0 = time.monotonic()
        engine.load_state_dict(new, version=1)
        report["load_s"] = round(time.monotonic() - t0, 3)
        groups = engine.generate(prompts, 4, params)
        got = torch.cat([s.logprobs for g in groups for s in g])
        report["stale_diff"] = _diff(got, response_logprobs(trainer, prompts, groups))  # still the old weights
        with torch.no_grad():
            for k, param in trainer.model.named_parameters():
                param.copy_(new[k])
        report["loaded_diff"] = _diff(got, response_logprobs(trainer, prompts, groups))
        record(name, report)
    finally:
        close(engine)
    return report


def verdict(report: dict[str, Any]) -> list[str]:
    """What failed in a `check` report, as lines; empty when it passed."""
    worst, mean = TOLERANCE[report["dtype"]]
    failures = [
        f"{key}: {report[key]} exceeds (max {worst}, mean {mean})"
        for key in ("logprob_diff", "loaded_diff")
        if report[key]["max"] > worst or report[key]["mean"] > mean
    ]
    if report["stale_diff"]["mean"] <= 10 * mean:
        failures.append(f"stale_diff {report['stale_diff']}: the loaded weights changed nothing")
    return failures
