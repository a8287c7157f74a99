"""Many samples per reward-pool round trip: each item still scored once, under its own deadline.

The pools run without isolation: the reward functions log their calls into the test's
directory, which a sandboxed process (its own /tmp) cannot see; tests/test_reward_sandbox.py
covers the sandbox, batches included (the real reward worker there scores through them)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from consumers.reward_batch import BatchScorer
from consumers.reward_pool import RewardPool, Score

LOGGED = "tests.reward_fns:logged"


def test_a_batch_keeps_the_scores_before_a_bad_item_and_scores_the_rest_once(
    tmp_path: Path,
) -> None:
    log = tmp_path / "calls"
    plain: dict[str, Any] = {"log": str(log)}
    items = [
        ("a", plain),
        ("bb", plain),
        ("", {"misbehave": "hang"}),
        ("dddd", plain),
        ("", {"misbehave": "segfault"}),
        ("ffffff", plain),
    ]

    async def main() -> list[Score]:
        async with RewardPool(processes=1, timeout=0.5, isolation="off") as pool:
            await pool.resolve(LOGGED)
            return await pool.score_many(LOGGED, items)

    assert asyncio.run(main()) == [
        Score(1.0),
        Score(2.0),
        Score.failure("timed out after 0.5s"),
        Score(4.0),
        Score.failure("reward process killed by SIGSEGV"),
        Score(6.0),
    ]
    # Every good item was scored exactly once: none again after its process was lost.
    assert log.read_text().split() == ["a", "bb", "dddd", "ffffff"]


def test_concurrent_calls_share_round_trips_and_each_gets_its_own_score(tmp_path: Path) -> None:
    texts = ["x" * n for n in range(64)]

    async def main() -> tuple[list[Score], int]:
        async with RewardPool(processes=2, timeout=5.0, isolation="off") as pool:
            await pool.resolve(LOGGED)
            scorer = BatchScorer(pool, LOGGED, batch=16)
            scores = await asyncio.gather(
                *(scorer.score(text, {"log": str(tmp_path / "calls")}) for text in texts)
            )
            return scores, scorer.round_trips

    scores, round_trips = asyncio.run(main())
    assert scores == [Score(float(n)) for n in range(64)]
    assert round_trips == 4  # 64 queued at once, 16 per trip


def test_a_lone_call_is_sent_at_once_and_a_bad_spec_reaches_every_caller() -> None:
    async def main() -> None:
        async with RewardPool(processes=2, timeout=5.0, isolation="off") as pool:
            scorer = BatchScorer(pool, "producers.tasks:score_reverse", batch=16)
            assert await scorer.score("321", {"name": "reverse", "target": "321"}) == Score(1.0)
            assert scorer.round_trips == 1
            bad = BatchScorer(pool, "no_such_module:f", batch=16)
            results = await asyncio.gather(
                *(bad.score("", {}) for _ in range(3)), return_exceptions=True
            )
            assert [type(r).__name__ for r in results] == ["RewardSpecError"] * 3

    asyncio.run(main())


def test_a_small_queue_is_spread_over_the_free_processes(tmp_path: Path) -> None:
    """Six queued on two free processes go three and three, not six behind one slow call."""

    async def main() -> int:
        async with RewardPool(processes=2, timeout=5.0, isolation="off") as pool:
            await pool.resolve(LOGGED)
            scorer = BatchScorer(pool, LOGGED, batch=16)
            await asyncio.gather(
                *(scorer.score("x", {"log": str(tmp_path / "calls")}) for _ in range(6))
            )
            return scorer.round_trips

    assert asyncio.run(main()) == 2


def test_a_call_made_as_the_last_sender_finishes_is_still_sent() -> None:
    """A handler woken by a sender's last batch scores its next item at once; it must not be
    left queued with no sender to take it."""
    task = {"name": "reverse", "target": "321"}

    async def main() -> None:
        async with RewardPool(processes=1, timeout=5.0, isolation="off") as pool:
            scorer = BatchScorer(pool, "producers.tasks:score_reverse", batch=1)

            async def one_after_another() -> list[Score]:
                return [await scorer.score("321", task) for _ in range(3)]

            calls = asyncio.create_task(one_after_another())
            _, pending = await asyncio.wait([calls], timeout=10)
            assert not pending, "a call was left queued with no sender"
            assert calls.result() == [Score(1.0)] * 3

    asyncio.run(main())
