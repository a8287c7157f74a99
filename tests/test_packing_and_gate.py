"""Pure arithmetic of the loop: the admission gate, group assembly, token-balanced packing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from consumers.buffer import Group
from consumers.packing import Row, balance, pack_step, split
from producers.gate import merge_ranks
from schemas.config import ConfigError, RunConfig, load_config
from tests.helpers import reward


def row(tokens: int, name: str = "") -> Row:
    prompt = np.arange(2, dtype=np.int32)
    response = np.arange(tokens - 2, dtype=np.int32)
    return Row(
        name or f"s{tokens}",
        prompt,
        response,
        np.zeros(tokens - 2, np.float32),
        np.zeros(tokens - 2, np.int32),
        1.0,
        0.5,
        "",
    )


def config(**algorithm: object) -> RunConfig:
    return RunConfig.model_validate(
        {
            "algorithm": {"prompts_per_step": 4, "max_staleness": 1, **algorithm},
            "trainer": {"steps": 10},
        }
    )


@pytest.mark.parametrize(
    ("version", "dropped", "limit"),
    [
        (0, 0, 8),  # (0 + 1 + 1) * 4: steps 0 and 1 may use version-0 samples
        (3, 0, 20),  # (3 + 1 + 1) * 4
        (3, 2, 22),  # each dropped group is replaced once
        (9, 0, 40),  # never more than steps * prompts_per_step (+ drops)
        (12, 1, 41),
    ],
)
def test_gate_admits_up_to_the_staleness_bound(version: int, dropped: int, limit: int) -> None:
    assert config().staleness.admitted_limit(version, dropped) == limit


def test_gate_with_zero_staleness_is_on_policy() -> None:
    assert config(max_staleness=0).staleness.admitted_limit(2, 0) == 12


def test_group_completes_and_names_its_drop_reason() -> None:
    group = Group("r/0/0", 2)
    group.add(reward("r", 0, 0, 1.0), None)  # type: ignore[arg-type]
    assert not group.complete
    group.add(reward("r", 0, 1, 1.0), None)  # type: ignore[arg-type]
    assert group.complete and group.drop_reason() == "all 2 rewards equal (1)"
    group.add(reward("r", 0, 1, 0.0), None)
    assert group.drop_reason() is None and group.min_version == 0
    failed = reward("r", 0, 1, 0.0).model_copy(
        update={"failed": True, "reason": "timeout after 5s"}
    )
    group.add(failed, None)
    assert group.drop_reason() == "failed sample r/0/0/1: timeout after 5s"


def test_balance_spreads_tokens_evenly_across_ranks() -> None:
    rows = [row(t, f"s{i}") for i, t in enumerate((50, 40, 30, 30, 20, 10, 10, 10))]
    buckets = balance(rows, 2)
    loads = [sum(r.tokens for r in b) for b in buckets]
    assert loads == [100, 100]
    assert sorted(r.sample_id for b in buckets for r in b) == sorted(r.sample_id for r in rows)


def test_an_episodes_segments_go_to_one_rank_longest_first() -> None:
    """A split episode's rows share its id (`Row.all_of`); each rank counts the samples it
    trained by id and the run adds the ranks' counts, so its rows go to one rank together."""
    rows = [row(t, f"s{i}") for i, t in enumerate((60, 50, 40))]
    rows += [row(t, "episode") for t in (45, 35, 5)]  # 85 tokens, three segments
    buckets = balance(rows, 2)
    holding = [i for i, b in enumerate(buckets) if any(r.sample_id == "episode" for r in b)]
    assert len(holding) == 1, [[r.sample_id for r in b] for b in buckets]
    assert sum(r.sample_id == "episode" for r in buckets[holding[0]]) == 3
    for b in buckets:  # `split` takes each rank's rows longest first
        assert [r.tokens for r in b] == sorted((r.tokens for r in b), reverse=True)
    assert sorted(sum(r.tokens for r in b) for b in buckets) == [110, 125]


def test_split_keeps_padded_micro_batches_under_the_token_budget() -> None:
    rows = sorted(
        (row(t, f"s{i}") for i, t in enumerate((64, 60, 33, 32, 31, 8))), key=lambda r: -r.tokens
    )
    batches = split(rows, max_tokens=128)
    assert [[r.tokens for r in b] for b in batches] == [[64, 60], [33, 32, 31], [8]]
    assert all(len(b) * max(r.tokens for r in b) <= 128 for b in batches)
    assert split([row(300)], 128)[0][0].tokens == 300  # an over-long row still travels, alone


class CountedRow(Row):
    """A row that counts how often its length is read (`reads`, shared by every instance)."""

    reads = 0

    @property
    def tokens(self) -> int:
        CountedRow.reads += 1
        return super().tokens


def test_split_reads_each_rows_length_a_bounded_number_of_times() -> None:
    """Linear in the rows of a step: a large run's step (8,192 rows into few micro-batches) took
    seconds of the buffer's time when each row re-read the lengths of the whole micro-batch."""
    base = row(8)
    rows = [
        CountedRow(f"s{i}", base.prompt, base.response, base.logprobs, base.versions, 1.0, 0.5, "")
        for i in range(2000)
    ]
    CountedRow.reads = 0
    batches = split(rows, max_tokens=8 * 1000)
    assert [len(b) for b in batches] == [1000, 1000]
    assert CountedRow.reads <= 2 * len(rows), (
        f"{CountedRow.reads} length reads for {len(rows)} rows"
    )


def test_pack_step_pads_right_and_masks_responses_only() -> None:
    ((micro,),) = pack_step([row(5, "a"), row(3, "b")], ranks=1, max_tokens=64)
    assert micro.input_ids.shape == (2, 5)
    assert micro.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert micro.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    assert micro.versions.tolist()[1] == [-1, -1, 0, -1, -1]


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "run.yaml"
    bad.write_text("algorithm:\n  max_staleness: -1\n")
    with pytest.raises(
        ConfigError,
        match=r"run.yaml: algorithm.max_staleness: Input should be greater than or equal to 0",
    ):
        load_config(bad)
    bad.write_text("trainer:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"trainer.stepz: Extra inputs are not permitted"):
        load_config(bad)
    bad.write_text("trainer:\n  dp_size: 2\n")
    with pytest.raises(
        ConfigError,
        match=r"run.yaml: trainer: dp_size 2 needs engine fsdp: .* no gradient all-reduce",
    ):
        load_config(bad)
    bad.write_text("trainer:\n  dp_size: 2\n  engine: fsdp\n")
    assert load_config(bad).trainer.dp_size == 2
    bad.write_text(
        "trainer:\n  dp_size: 5\n  engine: fsdp\nalgorithm:\n  prompts_per_step: 1\ndata:\n  n: 4\n"
    )
    with pytest.raises(ConfigError, match=r"trainer.dp_size 5 > the 4 rows of a step"):
        load_config(bad)
    bad.write_text("trainer:\n  engine: deepspeed\n")
    with pytest.raises(
        ConfigError,
        match=r"trainer.engine: Input tag 'deepspeed' found using 'type' does not match "
        r"any of the expected tags: 'torch', 'fsdp', 'megatron'",
    ):
        load_config(bad)
    bad.write_text("model:\n  dtype: float16\n")
    with pytest.raises(ConfigError, match=r"model.dtype: Input should be 'float32' or 'bfloat16'"):
        load_config(bad)
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read YAML"):
        load_config(bad)
    assert (
        load_config(Path(__file__).parent.parent / "examples" / "digits.yaml").data.task == "digits"
    )


def test_equal_reward_groups_are_kept_when_dynamic_sampling_is_off() -> None:
    group = Group("r/0/0", 2)
    group.samples[0] = (reward("r", 0, 0, 1.0), None)  # type: ignore[assignment]
    group.samples[1] = (reward("r", 0, 1, 1.0), None)  # type: ignore[assignment]
    assert group.drop_reason(drop_equal=False) is None
    assert group.drop_reason(drop_equal=True) == "all 2 rewards equal (1)"


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        # Would stall at step 2 with no message: the gate waits for a version never published.
        (
            "trainer: {sync_every: 3}\nalgorithm: {max_staleness: 1}\n",
            r"run.yaml: trainer.sync_every 3 > algorithm.max_staleness \+ 1 = 2: "
            r"the gate would wait",
        ),
        # A typo used to stall the run at the first complete group (KeyError in the buffer).
        (
            "algorithm: {advantage: grpoo}\n",
            r"algorithm.advantage: Input should be 'grpo', 'dr_grpo', 'rloo', 'reinforce_pp', "
            r"'reinforce_pp_baseline', 'passk' or 'gae'",
        ),
        (
            "algorithm: {policy_loss: ppo2}\n",
            r"algorithm.policy_loss: Input should be 'ppo', 'gspo' or 'cispo'",
        ),
        (
            "algorithm: {loss_aggregation: mean}\n",
            r"algorithm.loss_aggregation: Input should be 'token-mean'",
        ),
        # A group of one has no baseline: its advantage is 0 or undefined,
        # and it stalled the buffer.
        (
            "data: {n: 1}\nalgorithm: {drop_equal_reward_groups: false}\n",
            r"data.n 1: group-relative advantages need at least 2 samples per prompt",
        ),
    ],
)
def test_configs_that_would_stall_are_refused_at_load(
    tmp_path: Path, yaml_text: str, message: str
) -> None:
    bad = tmp_path / "run.yaml"
    bad.write_text(yaml_text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(bad)
    assert "\n" not in str(caught.value) and "Value error" not in str(caught.value)


def test_sync_every_up_to_max_staleness_plus_one_is_accepted(tmp_path: Path) -> None:
    ok = tmp_path / "run.yaml"
    ok.write_text("trainer: {sync_every: 3}\nalgorithm: {max_staleness: 2}\n")
    assert load_config(ok).trainer.sync_every == 3


def test_the_config_offers_exactly_the_algorithms_the_code_has() -> None:
    from typing import get_args

    import torch

    from engines.algorithms.advantages import ESTIMATORS, step_advantages
    from engines.algorithms.losses import AggregationMode
    from schemas.config import AlgorithmConfig

    fields = AlgorithmConfig.model_fields
    assert set(get_args(fields["advantage"].annotation)) == set(ESTIMATORS)
    for name in ESTIMATORS:  # each one the config offers is one the code computes
        assert len(step_advantages(name, [torch.tensor([0.0, 1.0])])[0]) == 2
    assert set(get_args(fields["loss_aggregation"].annotation)) == set(get_args(AggregationMode))
    assert set(get_args(fields["policy_loss"].annotation)) == {"ppo", "gspo", "cispo"}


def test_a_steps_records_from_every_rank_merge_into_one() -> None:
    common = {"step": 3, "loss": -0.5, "grad_norm": 0.7}
    ranks = [
        {
            **common,
            "time": 10.0,
            "train_seconds": 0.2,
            "samples": 2,
            "reward_mean": 1.0,
            "staleness_max": 0,
            "staleness_hist": [5],
            "sample_ids": ["a", "b"],
        },
        {
            **common,
            "time": 11.0,
            "train_seconds": 0.3,
            "samples": 6,
            "reward_mean": 0.0,
            "staleness_max": 1,
            "staleness_hist": [1, 4],
            "sample_ids": ["c", "d", "e", "f", "g", "h"],
        },
    ]
    merged = merge_ranks(ranks)
    assert merged == {
        **common,
        "time": 11.0,
        "train_seconds": 0.3,
        "samples": 8,
        "reward_mean": 0.25,
        "staleness_max": 1,
        "staleness_hist": [6, 4],
        "sample_ids": list("abcdefgh"),
    }
    assert merge_ranks(ranks[:1]) is ranks[0]
