"""The simulated rollout engine (scheduling studies only): its length distribution, its slots,
and samples the rest of the pipeline takes as real ones."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.build import build_train_engine
from engines.protocols import MicroBatch, RolloutEngine, SamplingParams
from engines.simulated import (
    LOGPROB,
    SimulatedRolloutEngine,
    SimulatedSettings,
    draw_lengths,
    finish_times,
)
from engines.simulated_train import SimulatedTrainEngine
from engines.tiny import build_tiny_model
from producers.tasks import VOCAB as TASK_VOCAB
from schemas.config import ConfigError, parse_config
from schemas.rollout_config import SimulatedRolloutConfig
from schemas.trainer_config import SimulatedTrainConfig

VOCAB, EOS = 32, 0  # the random ids must step over eos and still reach the last id


def engine(**settings: object) -> SimulatedRolloutEngine:
    return SimulatedRolloutEngine(torch.nn.Linear(1, 1), VOCAB, EOS, SimulatedSettings(**settings))  # type: ignore[arg-type]


def test_lengths_are_log_normal_with_the_median_and_sigma_asked_and_capped() -> None:
    lengths = draw_lengths(np.random.default_rng(0), 20_000, median=50, sigma=1.0, cap=10_000)
    assert np.median(lengths) == pytest.approx(50, rel=0.05)
    assert np.log(lengths).std() == pytest.approx(1.0, rel=0.05)
    assert np.percentile(lengths, 99) > 8 * 50  # the long tail: exp(2.33 sigma) ~ 10x the median
    capped = draw_lengths(np.random.default_rng(0), 20_000, median=50, sigma=1.0, cap=100)
    assert (
        capped.max() == 100
        and capped.min() >= 1
        and (capped == 100).mean() == pytest.approx(0.25, abs=0.02)
    )


def test_slots_run_jobs_as_a_continuous_batching_engine_would() -> None:
    assert finish_times([1.0] * 8, slots=4) == [1.0] * 4 + [2.0] * 4
    # The long job holds one slot; the other three take the short ones as they come free.
    assert finish_times([10.0, 1, 1, 1, 1, 1, 1], slots=4) == [10.0, 1, 1, 1, 2, 2, 2]
    assert max(finish_times([10.0, 1, 1, 1, 1, 1, 1], slots=1)) == 16


def test_generate_takes_the_makespan_and_returns_valid_samples() -> None:
    sim = engine(median_tokens=20, sigma=0.0, seconds_per_token=0.005, slots=2)
    assert isinstance(sim, RolloutEngine)
    started = time.perf_counter()
    groups = sim.generate([[1, 2], [3]], n=2, params=SamplingParams(max_tokens=40))
    seconds = time.perf_counter() - started
    # 4 samples of 20 tokens on 2 slots: 2 rounds of 20 x 5 ms.
    assert 0.2 <= seconds < 0.35, seconds
    assert [len(g) for g in groups] == [2, 2]
    for sample in (s for g in groups for s in g):
        ids = sample.token_ids
        assert len(ids) == 20 and sample.finish_reason == "stop" and ids[-1] == EOS
        assert int(ids.min()) >= 0 and int(ids.max()) < VOCAB and not (ids[:-1] == EOS).any()
        assert torch.equal(sample.logprobs, torch.full((20,), LOGPROB))
    capped = engine(median_tokens=100, sigma=0.0, seconds_per_token=0.0).generate(
        [[1]], 1, SamplingParams(max_tokens=8)
    )
    assert len(capped[0][0].token_ids) == 8 and capped[0][0].finish_reason == "length"
    sim.load_state_dict({}, version=7)
    assert sim.version == 7


def test_the_engine_and_its_workload_are_config() -> None:
    cfg = parse_config(
        {
            "rollout": {
                "engine": {"type": "simulated", "median_tokens": 200, "sigma": 1.2, "slots": 4}
            },
            "trainer": {"simulated_seconds_per_token": 1e-4},
        }
    )
    assert isinstance(cfg.rollout.engine, SimulatedRolloutConfig)
    assert cfg.rollout.engine.slots == 4 and cfg.trainer.simulated_seconds_per_token == 1e-4
    with pytest.raises(
        ConfigError,
        match="rollout.engine: Input tag 'trtllm' found using 'type' does not match any of "
        "the expected tags: 'hf', 'simulated', 'vllm', 'sglang'",
    ):
        parse_config({"rollout": {"engine": "trtllm"}})
    with pytest.raises(
        ConfigError,
        match=r"rollout.engine.slots: Input should be greater than or equal to 1 "
        r"\(type simulated\)",
    ):
        parse_config({"rollout": {"engine": {"type": "simulated", "slots": 0}}})


def test_samples_taken_one_at_a_time_end_with_their_own_length_and_pause_between_tokens() -> None:
    """`generate_sample` (continuous admission): a short sample returns when it ends, not with
    the long one beside it; `pause` stops every sample between tokens, and a version loaded
    meanwhile computes the rest of a sample's tokens (partial rollout)."""
    sim = engine(median_tokens=100, sigma=0.0, seconds_per_token=0.01, slots=2)
    with ThreadPoolExecutor(2) as pool:
        started = time.perf_counter()
        long = pool.submit(sim.generate_sample, [1], SamplingParams(max_tokens=40))
        short = pool.submit(sim.generate_sample, [1], SamplingParams(max_tokens=4))
        assert len(short.result().token_ids) == 4
        short_seconds = time.perf_counter() - started
        sim.pause()
        assert sim.computing == 0
        sim.load_state_dict({}, version=1)
        time.sleep(0.2)  # paused: not a token of `long` is computed meanwhile
        sim.resume()
        sample = long.result()
        long_seconds = time.perf_counter() - started
    # 40 tokens of 10 ms, and 0.2 s paused with no token computed.
    assert long_seconds >= 0.58, f"the long sample went on while paused: {long_seconds:.2f} s"
    assert short_seconds < 0.25, f"the short sample waited for the long one: {short_seconds:.2f} s"
    assert sample.versions is not None and len(sample.versions) == 40
    versions = sample.versions.tolist()
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1, versions
    assert 0 < versions.count(0) < 20, f"the pause did not stop the sample mid-way: {versions}"


def test_the_simulated_trainer_counts_versions_and_computes_no_step(tmp_path: Path) -> None:
    """`trainer.engine: simulated` (`ops.bench.scale`'s trainer): a step advances the version
    and reports the step's tokens, and the weights stay as loaded; a run must pair it with the
    simulated rollout engine, or the config is refused in one line."""
    model = build_tiny_model(tmp_path / "model", TASK_VOCAB)
    cfg = parse_config({"rollout": {"engine": "simulated"}, "trainer": {"engine": "simulated"}})
    assert isinstance(cfg.trainer.engine, SimulatedTrainConfig)
    trainer = build_train_engine(cfg.trainer.engine, model, lr=1e-2)
    assert isinstance(trainer, SimulatedTrainEngine) and trainer.name == "simulated"
    before = {k: v.clone() for k, v in trainer.export_weights().items()}
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    mask = torch.ones_like(ids)
    loss = torch.tensor([[0, 0, 1, 1, 1]])
    batch = MicroBatch(ids, mask, loss, torch.tensor([1.0]), torch.full((1, 5), -0.5) * loss)
    metrics = trainer.train_step([batch, batch])
    assert trainer.step == 1 and metrics["step"] == 1.0 and metrics["tokens"] == 6.0
    after = trainer.export_weights()
    assert all(torch.equal(before[k], after[k]) for k in before), "a simulated step changed weights"
    with pytest.raises(
        ConfigError,
        match="trainer.engine simulated computes no step .*: it needs rollout.engine "
        "simulated, not hf",
    ):
        parse_config({"trainer": {"engine": "simulated"}})
