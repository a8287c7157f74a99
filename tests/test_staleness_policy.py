"""The staleness bound's decisions (`schemas.staleness.StalenessPolicy`), against values computed
by hand. A run of 10 steps, 4 prompts a step, a checkpoint every 3 steps, unless said."""

from __future__ import annotations

import pytest

from schemas.config import ConfigError, RunConfig, parse_config
from schemas.staleness import StalenessPolicy


def policy(bound: int, **more: object) -> StalenessPolicy:
    shape: dict = {"prompts_per_step": 4, "steps": 10, "checkpoint_every": 3} | more
    return StalenessPolicy(bound=bound, **shape)


def test_the_config_builds_the_policy_from_its_own_keys() -> None:
    cfg = parse_config(
        {
            "algorithm": {"max_staleness": 2, "prompts_per_step": 5, "max_group_wait_steps": 7},
            "trainer": {"steps": 40, "checkpoint_every": 6},
        }
    )
    assert cfg.staleness == StalenessPolicy(
        bound=2, prompts_per_step=5, steps=40, checkpoint_every=6, max_group_wait_steps=7
    )
    assert parse_config({"mode": "sync"}).staleness.bound == 0
    assert parse_config({"mode": "sync"}).staleness.on_policy
    assert not RunConfig().staleness.on_policy  # the default bound is 1


@pytest.mark.parametrize(
    ("bound", "version", "dropped", "limit"),
    [
        (1, 0, 0, 8),  # versions 0, 1 of steps: (0 + 2) x 4
        (1, 3, 0, 20),  # (3 + 2) x 4
        (1, 3, 2, 22),  # each dropped group replaced once
        (0, 3, 0, 16),  # on-policy: step 3's prompts once version 3 is out, (3 + 1) x 4
        (0, 0, 0, 4),
        (2, 8, 1, 41),  # min(8 + 3, 10) x 4 + 1: never past the run's steps
    ],
)
def test_the_gate_admits_steps_v_to_v_plus_bound(
    bound: int, version: int, dropped: int, limit: int
) -> None:
    assert policy(bound).admitted_limit(version, dropped) == limit


@pytest.mark.parametrize(
    ("bound", "issued", "version", "dropped", "waits_for"),
    [
        (1, 8, 0, 0, 1),  # 8 issued = steps 0, 1: step 2's first prompt needs version 1
        (1, 7, 0, 0, None),  # one more may go at version 0
        (1, 9, 0, 1, 1),  # a drop replaced: still steps 0, 1's worth
        (0, 4, 0, 0, 1),  # on-policy: step 1's prompts need version 1
        (0, 13, 2, 0, 3),  # past the limit 12 of v2: v3's limit 16 is the first above 13
        (2, 12, 0, 0, 1),  # steps 0..2 issued at version 0: step 3 needs version 1
        (1, 40, 9, 0, None),  # the whole run issued: no version opens the gate
    ],
)
def test_a_shut_gate_waits_for_the_lowest_version_that_opens_it(
    bound: int, issued: int, version: int, dropped: int, waits_for: int | None
) -> None:
    p = policy(bound)
    assert p.waits_for(issued, version, dropped) == waits_for
    if waits_for is not None:  # the inverse is exact: that version opens it, the one before not
        assert issued < p.admitted_limit(waits_for, dropped)
        assert issued >= p.admitted_limit(waits_for - 1, dropped)


@pytest.mark.parametrize(
    ("bound", "version", "step", "too_old"),
    [
        (0, 4, 5, True),  # sync: one version behind is not on-policy
        (0, 5, 5, False),
        (1, 4, 5, False),
        (1, 3, 5, True),
        (2, 3, 5, False),
        (2, 2, 5, True),
    ],
)
def test_a_token_is_too_old_past_the_bound(
    bound: int, version: int, step: int, too_old: bool
) -> None:
    p = policy(bound)
    assert p.too_old(version, step) is too_old
    assert p.oldest_version(step) == step - bound


def test_the_audit_counts_tokens_past_the_bound_in_a_histogram() -> None:
    hist = [5, 4, 3, 2]  # 5 tokens at staleness 0, 4 at 1, 3 at 2, 2 at 3
    assert policy(0).over_bound(hist) == 4 + 3 + 2
    assert policy(1).over_bound(hist) == 3 + 2
    assert policy(3).over_bound(hist) == 0
    assert policy(1).over_bound([]) == 0


def test_what_the_streams_and_the_buffer_keep_follows_the_bound() -> None:
    assert policy(1).steps_ahead == 2
    assert policy(1).in_flight_prompts == 8  # 2 steps x 4 prompts
    assert policy(0).in_flight_prompts == 4
    assert policy(1).batch_steps_kept == 1 + 3 + 2  # step C-1, 3 to the next checkpoint, 2 ahead
    assert policy(4, steps=5).batch_steps_kept == 5  # never more than the run
    assert policy(1).group_wait_steps == 2  # default: the steps ahead
    assert policy(1, max_group_wait_steps=5).group_wait_steps == 5


def test_versions_must_come_within_the_steps_the_gate_runs_ahead() -> None:
    assert policy(1).versions_in_time(2)
    assert not policy(1).versions_in_time(3)
    assert policy(0).versions_in_time(1)
    assert not policy(0).versions_in_time(2)
    refused = r"trainer.sync_every 3 > algorithm.max_staleness \+ 1 = 2"
    with pytest.raises(ConfigError, match=refused):
        parse_config({"trainer": {"sync_every": 3}})


def test_mode_sync_sets_the_bound_0_and_refuses_another() -> None:
    cfg = parse_config({"mode": "sync"})
    assert (cfg.staleness.bound, cfg.trainer.sync_every) == (0, 1)
    with pytest.raises(ConfigError, match="max_staleness must be 0"):
        parse_config({"mode": "sync", "algorithm": {"max_staleness": 1}})
    with pytest.raises(ConfigError, match="sync_every must be 1"):
        parse_config({"mode": "sync", "trainer": {"sync_every": 2}})
