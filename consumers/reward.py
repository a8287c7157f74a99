"""The reward worker: trajectories in, scored RewardEvents out (a whole group's as one event).

    python -m consumers.reward --run R [--nats URL]

Each trajectory's `response_text` and `task` go to the run's reward function
(`config.data.reward`) in a process pool with a deadline (`consumers.reward_pool`).
Whatever that function does — hang, crash, return garbage — the trajectory gets a
RewardEvent, failed with a reason if need be, so its group can still be accounted for; the
first failure of each distinct reason (`schemas.kv_records.failure_key`) is logged here.
The RewardEvent is stored before the trajectory is acked, so the trajectories of a killed
worker are redelivered and scored again, and the shared id makes the re-publish a
duplicate the stream drops. SIGTERM stops fetching, finishes what was fetched, and exits.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
from nats.aio.msg import Msg
from opentelemetry.trace import StatusCode

from bus import metrics, tracing
from bus.crashpoints import REWARD_MID_SCORING
from bus.runtime import Runtime
from bus.stage import Stage, run_stage
from bus.topology import REWARDS, TRAJECTORIES
from bus.worker import Handler, WorkerOptions
from consumers.group_publish import store_rewards
from consumers.reward_batch import BatchScorer
from consumers.reward_pool import RewardPool, RewardSpecError, Score
from consumers.reward_sandbox import IsolationUnavailable
from schemas import (
    RewardEvent,
    Tensor,
    Trajectories,
    TrajectoryEvent,
)
from schemas.kv_records import failure_key
from schemas.turn_rewards import trajectory_turn_rewards

log = logging.getLogger("jetrl.reward")
LOGGED_REASONS = 100
"""Most distinct failure reasons one worker logs (a message quoting each sample is many)."""


def reward_handler(rt: Runtime, pool: RewardPool) -> Handler[Trajectories]:
    """Score each sample of a trajectory event (one, or a whole group) with the run's reward
    function and store its reward event, a group's as one (`schemas.group_events`); the samples
    and the handlers running at once share round trips to the pool (`consumers.reward_batch`)."""
    scorer = BatchScorer(pool, rt.config.data.reward, rt.config.reward.batch)
    seen: set[str] = set()  # failure reasons logged: each distinct one once (`failure_key`)
    turn_credit = rt.config.agent is not None and rt.config.agent.turn_rewards

    async def score(event: TrajectoryEvent) -> RewardEvent:
        with tracing.tracer.start_as_current_span(
            "reward",
            attributes={
                "jetrl.prompt_id": event.prompt_id,
                "jetrl.sample_index": event.sample_index,
                "jetrl.worker": rt.source,
            },
        ) as span:
            REWARD_MID_SCORING(event.id)
            score = await scorer.score(event.response_text, event.task)
            turns, score = turn_rewards(event, score) if turn_credit else (None, score)
            span.set_attributes({"jetrl.reward": score.reward, "jetrl.failed": score.failed})
            if score.failed:  # shown as an error in Jaeger; the sample still flows, scored 0
                span.set_attribute("jetrl.reason", score.reason)
                span.set_status(StatusCode.ERROR, score.reason)
        return RewardEvent(
            id=event.id,
            run=rt.topology.run,
            source=rt.source,
            trajectory=event,
            reward=score.reward,
            components=score.components,
            failed=score.failed,
            reason=score.reason,
            turn_rewards=None if turns is None else Tensor.from_numpy(turns),
        )

    def counted(reward: RewardEvent) -> None:
        metrics.count_samples("reward", "failed" if reward.failed else "scored")
        key = failure_key(reward.reason) if reward.failed else ""
        if key and key not in seen and len(seen) < LOGGED_REASONS:
            seen.add(key)
            log.warning(
                "reward function %s failed on sample %s: %s (first failure of this kind; the "
                "run counts the others: progress line, ops.status, summary.json)",
                rt.config.data.reward,
                reward.id,
                key,
            )
        if not reward.failed:
            metrics.REWARD.record(reward.reward)

    async def handle(event: Trajectories, _msg: Msg) -> None:
        rewards = await asyncio.gather(*(score(t) for t in event.each()))
        await store_rewards(rt.publisher, REWARDS, event, list(rewards), rt.source)
        for reward in rewards:
            counted(reward)

    return handle


def turn_rewards(event: TrajectoryEvent, score: Score) -> tuple[np.ndarray | None, Score]:
    """`agent.turn_rewards`: the episode's turn rewards float32 [K] for its RewardEvent, and the
    score; a sample whose rewards do not fit its model turns fails with the reason (its group
    is dropped and replaced, as for any failed score), never a reward on the wrong token."""
    try:
        return trajectory_turn_rewards(event.task, event.segments()), score
    except ValueError as exc:
        return None, Score.failure(f"turn rewards: {exc}")


async def build(rt: Runtime) -> Stage[Trajectories]:
    """The reward stage: trajectories scored in a process pool. A function that cannot be
    imported would fail every sample: RewardSpecError refuses to start instead.

    Twice as many messages in hand as a round of full batches needs (`reward.batch` per pool
    process), so a process never waits for the next fetch.
    """
    reward = rt.config.reward
    pool = await RewardPool(
        reward.processes, reward.timeout, isolation=reward.isolation
    ).__aenter__()
    try:
        await pool.resolve(rt.config.data.reward)
    except BaseException:
        await pool.close()
        raise
    log.info(
        "scoring run %s with %s in %d processes",
        rt.topology.run,
        rt.config.data.reward,
        pool.processes,
    )
    options = WorkerOptions(concurrency=2 * pool.processes * rt.config.reward.batch)
    return Stage(TRAJECTORIES, reward_handler(rt, pool), options, close=pool.close)


def main() -> None:
    run_stage(
        "reward",
        build,
        "Score trajectories with the run's reward function.",
        RewardSpecError,
        IsolationUnavailable,
    )


if __name__ == "__main__":
    main()
