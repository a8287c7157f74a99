"""`lend: true`, its pure parts: when a waiting trainer lends its device (`should_lend`), and
what lending refuses on load, in one line (`schemas.placement.lend_refusal`). The lent run
itself: tests/test_lending_job.py."""

from __future__ import annotations

from typing import Any

import pytest

from consumers.lending import should_lend
from schemas.config import ConfigError, parse_config

LENDING: dict[str, Any] = {"lend": True, "rollout": {"engine": "simulated"}}


def test_a_trainer_lends_only_after_waiting_and_with_a_published_version() -> None:
    assert should_lend(waited=2.0, lend_after=2.0, lending=False, has_weights=True)
    assert not should_lend(waited=1.9, lend_after=2.0, lending=False, has_weights=True)
    assert not should_lend(waited=5.0, lend_after=2.0, lending=True, has_weights=True)
    assert not should_lend(waited=5.0, lend_after=2.0, lending=False, has_weights=False)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"rollout": {"engine": "hf"}}, "rollout.engine hf cannot stop between two tokens"),
        ({"trainer": {"engine": "fsdp"}}, "needs trainer.engine torch with dp_size 1"),
        (
            {"placement": "colocated", "rollout": {"engine": "simulated", "continuous": False}},
            "needs placement separated",
        ),
    ],
)
def test_what_lending_cannot_do_is_refused_in_one_line(change: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({**LENDING, **change})
    assert said in str(refused.value) and "\n" not in str(refused.value)
    lending = parse_config({**LENDING, "trainer": {"lend_after": 0.5}})
    assert lending.lend and lending.trainer.lend_after == 0.5
    assert not parse_config({}).lend  # the default: nothing lent
    with pytest.raises(ConfigError, match="lend_after"):
        parse_config({**LENDING, "trainer": {"lend_after": 0}})
