"""The KV records (`schemas.kv_records`): each family's key declares its record, each record
reads back what it wrote, and records stored in their old form (golden bytes below, as the
code before these models wrote them) still read."""

from __future__ import annotations

import json
import math

import pytest

from bus.topology import (
    DROPS,
    KV_KEYS,
    LOSS,
    MEMBERS,
    METRICS,
    RENDEZVOUS,
    drop_key,
    dropped_prompt,
    metrics_key,
    metrics_of,
)
from schemas.kv_records import DropRecord, LossRecord, Member, Rendezvous, StepMetrics

OLD_DROP = b"all 2 rewards equal (1)"
"""A drop record as the buffer stored it before: the reason as plain text."""
OLD_REFUSED = b"rollout: rejected: prompt of 70 tokens does not fit the model's 64"
"""A refused prompt's record as the rollout stored it before: its reason after a prefix."""
OLD_METRICS = (
    b'{"step": 3, "time": 1700000000.5, "train_seconds": 0.25, "samples": 4, "reward_mean": 0.5, '
    b'"staleness_max": 1, "staleness_hist": [10, 2], "sample_ids": ["r/0/1/0", "r/0/1/1"], '
    b'"loss": -0.125, "grad_norm": 0.75, "kl_coef": 0.1, "kl_reward": 0.02}'
)
"""A trainer rank's step record as `json.dumps(step_metrics(...))` stored it before."""
OLD_MEMBER = (
    b'{"role":"rollout","node":"n1","pid":42,"engine":"hf","weight_version":3,'
    b'"started_at":1.0,"updated_at":2.0}'
)


def test_every_key_family_names_its_record() -> None:
    assert (DROPS.record, METRICS.record, LOSS.record, RENDEZVOUS.record, MEMBERS.record) == (
        DropRecord,
        StepMetrics,
        LossRecord,
        Rendezvous,
        Member,
    )
    assert [k.pattern for k in KV_KEYS if k.record is None] == ["config"]  # the run's YAML


def test_keys_are_built_and_parsed_by_one_function_each() -> None:
    assert dropped_prompt(drop_key("r/0/7")) == "r/0/7"
    assert dropped_prompt(metrics_key(0, 7)) is None
    assert metrics_of(metrics_key(2, 17)) == (2, 17)
    assert metrics_of(drop_key("r/0/7")) is None
    assert metrics_of("metrics.x.1") is None


def test_an_old_drop_record_reads_as_a_reason() -> None:
    assert DropRecord.decode(OLD_DROP) == DropRecord(reason="all 2 rewards equal (1)")
    assert DropRecord.decode(None) == DropRecord(reason="")  # stored without a reason
    assert DropRecord.decode(b"{not json") == DropRecord(reason="{not json")


def test_an_old_refused_record_reads_as_refused_by_its_field() -> None:
    record = DropRecord.decode(OLD_REFUSED)
    assert record.refused
    assert record.reason == "rejected: prompt of 70 tokens does not fit the model's 64"
    assert record.text == OLD_REFUSED.decode()  # what the audit and the logs show, as before


@pytest.mark.parametrize(
    "record",
    [
        DropRecord(reason="stale: version 0 < 1 at step 1"),
        DropRecord(reason="rejected: too long", refused=True),
    ],
)
def test_a_drop_record_reads_back_what_it_wrote(record: DropRecord) -> None:
    assert DropRecord.decode(record.encode()) == record


def test_an_old_step_record_reads_with_the_engines_numbers_apart() -> None:
    record = StepMetrics.decode(OLD_METRICS)
    assert (record.step, record.samples, record.staleness_hist) == (3, 4, [10, 2])
    assert (record.kl_coef, record.kl_reward) == (0.1, 0.02)
    assert record.trained == {"loss": -0.125, "grad_norm": 0.75}
    assert StepMetrics.decode(record.encode()) == record
    assert record.flat() == json.loads(OLD_METRICS)  # the same flat form


def test_a_step_record_without_samples_or_kl_keeps_its_form() -> None:
    record = StepMetrics(
        step=0,
        time=1.0,
        train_seconds=0.1,
        samples=0,
        reward_mean=math.nan,
        staleness_max=0,
        staleness_hist=[],
        sample_ids=[],
        trained={"loss": 0.0},
    )
    flat = record.flat()
    assert "kl_coef" not in flat and "kl_reward" not in flat
    assert math.isnan(StepMetrics.decode(record.encode()).reward_mean)


def test_what_is_not_a_step_record_is_refused() -> None:
    for bad in (b"", b"[]", b"{}", b'{"step": 1, "time": 2}'):
        with pytest.raises(ValueError):
            StepMetrics.decode(bad)


def test_loss_members_and_rendezvous_read_their_stored_form() -> None:
    assert LossRecord.decode(b"6") == LossRecord(count=6)
    assert LossRecord(count=6).encode() == b"6"
    member = Member.decode(OLD_MEMBER)
    assert (member.role, member.pid, member.weight_version) == ("rollout", 42, 3)
    assert Member.decode(member.encode()) == member
    old = b'{"host": "10.0.0.1", "port": 29500, "world_size": 2, "generation": "abc"}'
    announced = Rendezvous(host="10.0.0.1", port=29500, world_size=2, generation="abc")
    assert Rendezvous.decode(old) == announced
    with pytest.raises(ValueError):
        Member.decode(OLD_MEMBER.replace(b'"pid":42', b'"pid":42,"extra":1'))  # extra forbidden
