"""The vLLM and SGLang adapters against the trainer, on a GPU: the `external` section of
`ops.gpu_check` and the body of tests/test_gpu_engines.py.

One check per engine: generate n samples per prompt at a temperature that is not 1; the
trainer (`TorchTrainEngine`, same weights, same temperature) recomputes every response
token's log-prob; then new weights go into the running engine (`load_state_dict`) and into
the trainer, and the comparison is repeated -- against the old weights too, which must now
disagree, or the load did nothing.

And one continuous check per engine and partial mode (`check_continuous`): the continuous
adapter (`engines.vllm_continuous`, `engines.sglang_continuous`) generates samples one request
each from several threads; while they are mid-way it is paused, given new weights and resumed
(partial rollout); every token's log-prob is compared with the trainer's under the version
the token is tagged with, and the versions must step up once, in the samples that spanned
the load.
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


def response_logprobs(
    trainer: TorchTrainEngine, prompts: list[list[int]], groups: list[list[Sample]]
) -> torch.Tensor:
    """[sum of response lengths] the trainer's log-prob of every response token, in the order
    of `groups`' samples (rows prompt + response, right-padded)."""
    rows = [
        (prompt, s.token_ids.tolist())
        for prompt, group in zip(prompts, groups, strict=True)
        for s in group
    ]
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

        return VLLMRolloutEngine(
            model_dir,
            VLLMSettings(
                gpu_memory_utilization=0.25, max_model_len=256, enforce_eager=True, dtype=dtype
            ),
        )
    from engines.sglang_rollout import SGLangRolloutEngine, SGLangSettings

    return SGLangRolloutEngine(
        model_dir, SGLangSettings(mem_fraction_static=0.25, context_length=256, dtype=dtype)
    )


def close(engine: Any) -> None:
    """Frees the engine's GPU memory before the next one starts."""
    if hasattr(engine, "close"):  # continuous adapters, SGLang's batch one: engine and thread
        engine.close()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def make_continuous(name: str, model_dir: Path, dtype: str, mode: str, slots: int) -> Any:
    """The continuous adapter `name` with a small memory share, eager, a short context."""
    if name == "vllm":
        from engines.vllm_continuous import VLLMContinuousEngine
        from engines.vllm_rollout import VLLMSettings

        settings = VLLMSettings(
            gpu_memory_utilization=0.25, max_model_len=256, enforce_eager=True, dtype=dtype
        )
        return VLLMContinuousEngine(model_dir, settings, slots=slots, partial_mode=mode)  # type: ignore[arg-type]
    from engines.sglang_continuous import SGLangContinuousEngine
    from engines.sglang_rollout import SGLangSettings

    sglang_settings = SGLangSettings(mem_fraction_static=0.25, context_length=256, dtype=dtype)
    return SGLangContinuousEngine(model_dir, sglang_settings, slots=slots, partial_mode=mode)  # type: ignore[arg-type]


def check_continuous(
    name: str,
    model_dir: Path,
    mode: str = "resubmit",
    dtype: str = "float32",
    put: Callable[[str, Any], None] | None = None,
) -> dict[str, Any]:
    """Partial rollout on the continuous adapter `name` (see the module doc); its figures."""
    from concurrent.futures import ThreadPoolExecutor

    key = f"{name}_continuous_{mode}"
    report: dict[str, Any] = {"dtype": dtype, "mode": mode}
    record = put or (lambda key, value: None)
    slots, samples = 16, 32
    started = time.monotonic()
    engine = make_continuous(name, model_dir, dtype, mode, slots)
    report["start_s"] = round(time.monotonic() - started, 1)
    trainer = TorchTrainEngine(
        model_dir, lr=1e-3, loss=LossConfig(temperature=TEMPERATURE), device="cuda"
    )
    gen = torch.Generator().manual_seed(0)
    # nn.Module's attributes are typed Tensor | Module; a HF model has this method.
    vocab = trainer.model.get_input_embeddings().num_embeddings  # type: ignore[operator]
    prompts = torch.randint(1, vocab - 1, (samples, 12), generator=gen).tolist()
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=200)
    old = trainer.export_weights()
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in old.items()}
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(slots) as pool:
            futures = [pool.submit(engine.generate_sample, p, params) for p in prompts]
            while sum(f.done() for f in futures) < samples // 4 and time.monotonic() - t0 < 60:
                time.sleep(0.001)  # the first ones ended: the samples after them are mid-way
            t1 = time.monotonic()
            engine.pause()
            t2 = time.monotonic()
            engine.load_state_dict(new, version=1)
            t3 = time.monotonic()
            engine.resume()
            report["pause_s"], report["load_s"], report["resume_s"] = (
                round(t2 - t1, 3),
                round(t3 - t2, 3),
                round(time.monotonic() - t3, 3),
            )
            done = [f.result(timeout=120) for f in futures]
        seconds = time.monotonic() - t0
        tokens = sum(len(s.token_ids) for s in done)
        report["generate"] = {
            "samples": len(done),
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1),
        }
        versions = [s.versions.tolist() for s in done]
        report["spanning"] = sum(1 for v in versions if {0, 1} <= set(v))
        report["monotone"] = all(v == sorted(v) for v in versions)
        groups = [[s] for s in done]
        under_old = response_logprobs(trainer, prompts, groups)
        with torch.no_grad():
            for k, param in trainer.model.named_parameters():
                param.copy_(new[k])
        under_new = response_logprobs(trainer, prompts, groups)
        tagged = torch.cat([s.versions for s in done]) == 1
        got = torch.cat([s.logprobs for s in done])
        report["logprob_diff"] = _diff(got, torch.where(tagged, under_new, under_old))
        record(key, report)
    finally:
        close(engine)
    return report


def verdict_continuous(report: dict[str, Any]) -> list[str]:
    """What failed in a `check_continuous` report, as lines; empty when it passed."""
    worst, mean = TOLERANCE[report["dtype"]]
    failures = []
    diff = report["logprob_diff"]
    if diff["max"] > worst or diff["mean"] > mean:
        failures.append(
            f"logprob_diff {diff} exceeds (max {worst}, mean {mean}): "
            "tokens tagged with the wrong version?"
        )
    if not report["monotone"]:
        failures.append("a sample's versions went back")
    if not report["spanning"]:
        failures.append("no sample spanned the load: the pause drained instead of interrupting")
    return failures


def _diff(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    err = (got - want).abs()
    return {"max": round(err.max().item(), 5), "mean": round(err.mean().item(), 6)}


def check(
    name: str,
    model_dir: Path,
    dtype: str = "float32",
    put: Callable[[str, Any], None] | None = None,
) -> dict[str, Any]:
    """Runs the check on engine `name`; returns (and `put`s as it goes) its figures."""
    report: dict[str, Any] = {"dtype": dtype}
    record = put or (lambda key, value: None)
    started = time.monotonic()
    engine = make(name, model_dir, dtype)
    report["start_s"] = round(time.monotonic() - started, 1)
    trainer = TorchTrainEngine(
        model_dir, lr=1e-3, loss=LossConfig(temperature=TEMPERATURE), device="cuda"
    )
    gen = torch.Generator().manual_seed(0)
    vocab = trainer.model.get_input_embeddings().num_embeddings  # type: ignore[operator]  # as above
    prompts = torch.randint(1, vocab - 1, (8, 12), generator=gen).tolist()
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=32)
    try:
        t0 = time.monotonic()
        groups = engine.generate(prompts, 4, params)
        seconds = time.monotonic() - t0
        tokens = sum(len(s.token_ids) for g in groups for s in g)
        report["generate"] = {
            "samples": sum(map(len, groups)),
            "tokens": tokens,
            "seconds": round(seconds, 3),
        }
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
        report["stale_diff"] = _diff(
            got, response_logprobs(trainer, prompts, groups)
        )  # still the old weights
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
