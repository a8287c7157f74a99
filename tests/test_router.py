"""The rollout router (`engines.router`): the built-ins' choices, option checks,
`module:Class` loading."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from engines.router import (
    BUILT_IN,
    LeastInFlight,
    Router,
    RouterError,
    StickyByKey,
    make_router,
)
from schemas.config import ConfigError, parse_config
from schemas.rollout_config import BUILT_IN_ROUTERS


class LastReplica:
    """A plugged-in router: always the last replica; `offset` counts back from it."""

    def __init__(self, copies: int, offset: int = 0) -> None:
        self.copies, self.offset = copies, offset

    def pick(self, key: str | None, in_flight: Sequence[int]) -> int:
        return len(in_flight) - 1 - self.offset


class NoPick:
    def __init__(self, copies: int) -> None:
        pass


def test_least_in_flight_picks_the_fewest_and_the_lowest_index_among_equals() -> None:
    router = make_router("least_in_flight", 3)
    assert isinstance(router, LeastInFlight)
    assert router.pick(None, [0, 0, 0]) == 0
    assert router.pick("k", [2, 1, 1]) == 1
    assert router.pick(None, [3, 4, 2]) == 2
    # As a worker routes: each pick counted in flight before the next, prompts alternate.
    in_flight = [0, 0]
    picks = []
    for _ in range(6):
        picks.append(router.pick(None, in_flight))
        in_flight[picks[-1]] += 1
    assert picks == [0, 1, 0, 1, 0, 1]


def test_sticky_by_key_keeps_a_key_on_its_replica_and_sends_new_keys_to_the_least_loaded() -> None:
    router = make_router("sticky_by_key", 2)
    assert isinstance(router, StickyByKey)
    assert router.pick("a", [0, 0]) == 0
    assert router.pick("b", [1, 0]) == 1
    # However loaded its replica is, a known key stays there.
    assert router.pick("a", [9, 0]) == 0
    assert router.pick("b", [0, 9]) == 1
    # No key: the least loaded, and nothing remembered.
    assert router.pick(None, [5, 1]) == 1
    assert router.pick("c", [5, 1]) == 1
    assert router.pick("c", [0, 5]) == 1


def test_sticky_by_key_forgets_the_least_recently_used_key_past_max_keys() -> None:
    router = make_router("sticky_by_key", 2, {"max_keys": 2})
    assert isinstance(router, StickyByKey)
    assert router.pick("a", [0, 0]) == 0
    assert router.pick("b", [1, 0]) == 1
    assert router.pick("a", [0, 9]) == 0  # "a" used again: "b" is now the oldest
    assert router.pick("c", [0, 0]) == 0  # a third key: "b" forgotten
    assert set(router.table) == {"a", "c"}
    assert router.pick("b", [3, 0]) == 1  # routed as new: the least loaded
    assert list(router.table) == ["c", "b"]  # "a", the oldest then, forgotten: the table stays at 2


@pytest.mark.parametrize(
    ("name", "options", "error"),
    [
        (
            "sticky_by_key",
            {"max_key": 10},
            "router 'sticky_by_key': option max_key: Extra inputs are not permitted",
        ),
        (
            "sticky_by_key",
            {"max_keys": 0},
            "router 'sticky_by_key': option max_keys: Input should be greater than or equal to 1",
        ),
        (
            "least_in_flight",
            {"max_keys": 10},
            "router 'least_in_flight': option max_keys: Extra inputs are not permitted",
        ),
        (
            "round_robin",
            {},
            "router 'round_robin': expected one of least_in_flight, "
            "sticky_by_key or 'module:Class'",
        ),
        (
            "no_such_module_xyz:Router",
            {},
            "router 'no_such_module_xyz:Router': cannot import no_such_module_xyz: "
            "ModuleNotFoundError",
        ),
        (
            "tests.test_router:Missing",
            {},
            "router 'tests.test_router:Missing': tests.test_router has no class Missing",
        ),
        (
            "tests.test_router:NoPick",
            {},
            "router 'tests.test_router:NoPick': NoPick is not a router (no pick(key, "
            "in_flight) method)",
        ),
        (
            "tests.test_router:LastReplica",
            {"offst": 1},
            "router 'tests.test_router:LastReplica': cannot build it with options ['offst']",
        ),
    ],
)
def test_a_router_that_cannot_be_built_is_one_line_naming_it(
    name: str, options: dict, error: str
) -> None:
    with pytest.raises(RouterError) as raised:
        make_router(name, 2, options)
    message = str(raised.value)
    assert message.startswith(error), message
    assert "\n" not in message


def test_a_module_class_router_is_built_with_its_options() -> None:
    router = make_router("tests.test_router:LastReplica", 3, {"offset": 1})
    assert isinstance(router, LastReplica) and isinstance(router, Router)
    assert router.copies == 3
    assert router.pick(None, [0, 0, 0]) == 1


def test_the_config_takes_engine_copies_and_a_router_and_refuses_a_malformed_name() -> None:
    config = parse_config(
        {
            "rollout": {
                "engine_copies": 2,
                "router": "sticky_by_key",
                "router_options": {"max_keys": 8},
            }
        }
    )
    rollout = config.rollout
    assert (rollout.engine_copies, rollout.router) == (2, "sticky_by_key")
    assert rollout.router_options == {"max_keys": 8}
    assert parse_config({}).rollout.router == "least_in_flight"
    assert parse_config(
        {"rollout": {"router": "tests.test_router:LastReplica"}}
    ).rollout.router.endswith(":LastReplica")
    with pytest.raises(
        ConfigError,
        match=r"^config: rollout.router: 'sticky': expected one of least_in_flight, "
        r"sticky_by_key or 'module:Class'$",
    ):
        parse_config({"rollout": {"router": "sticky"}})
    with pytest.raises(ConfigError, match=r"^config: rollout.router: 'mod:not a class'"):
        parse_config({"rollout": {"router": "mod:not a class"}})
    too_few = r"^config: rollout.engine_copies: Input should be greater than or equal to 1$"
    with pytest.raises(ConfigError, match=too_few):
        parse_config({"rollout": {"engine_copies": 0}})
    # The old name is refused in one line that gives the new one (a user's YAML of before).
    renamed = r"^config: rollout: replicas was renamed to engine_copies: write engine_copies: 2$"
    with pytest.raises(ConfigError, match=renamed):
        parse_config({"rollout": {"replicas": 2}})


def test_the_config_names_exactly_the_built_in_routers() -> None:
    assert tuple(BUILT_IN) == BUILT_IN_ROUTERS
