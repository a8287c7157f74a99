"""`python -m consumers.buffer --run R`: scored samples in, gradient-ready batches out.

The loop holds every RewardEvent *unacked* until the batch containing it is stored (the
stream is the state: a buffer that dies loses nothing, its inputs are redelivered).

    reward (a sample's event, or a whole group's: `schemas.group_events`)
        -> cannot ever be batched? -> Reject (to dead, with the reason; a group's event whole,
           its prompt recorded as dropped)
        -> group by prompt id -> complete group?
        failed sample / all-equal rewards / non-finite advantages -> drop (KV
        `drop.<prompt id>` = a DropRecord typed by its kind, `consumers.buffer_groups`), ack;
        past `max_regenerations` x prompts_per_step equal drops in one step, equal groups train
        else -> ready
        incomplete for more than max_group_wait_steps formed steps -> drop (KV), to dead
    ready groups >= prompts_per_step -> drop the too-stale ones, advantages (KL in reward:
        score - beta_s * sum KL per sample first), pack
        -> publish BatchEvents for step s (with beta_s and the step's KL) -> ack the step's
        samples -> s + 1, beta_{s+1} (adaptive KL: from beta_s and the step's KL)

It reads `rewards`, or `scored` when the run has the reference stage (`reference.enabled`):
then every sample carries its reference log-probs, which ride on into the batch.

A restarted buffer first reads the batch stream: sample ids already batched are acked and
skipped when redelivered, and a step it had only partly stored is re-formed from the
same groups (the batch events list them) and re-published (dedup absorbs the repeats);
the KL coefficient goes on from the last stored step's (`next_kl_coef`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict

import nats.errors
import numpy as np
from nats.aio.msg import Msg
from nats.errors import MsgAlreadyAckdError
from nats.js.errors import KeyWrongLastSequenceError
from opentelemetry.context import Context

from bus import metrics, tracing
from bus.crashpoints import BUFFER_MID_STEP, BUFFER_STEP_STORED, armed
from bus.dead import dead_letter
from bus.runtime import Runtime
from bus.stage import Stage, run_stage
from bus.topology import BATCHES, drop_key
from bus.worker import HOLD, Hold, Reject, WorkerOptions, consumer_ack_wait
from consumers.buffer_groups import Group, episode_stats, regenerations_left
from consumers.buffer_groups import step_advantages as group_advantages
from consumers.buffer_replay import BatchedSoFar, next_kl_coef, read_batches
from consumers.packing import Row, bytes_per_token, pack_step, row_too_long
from schemas import BatchEvent, RewardEvent, RewardGroupEvent, Rewards, Tensor
from schemas.kv_records import DropKind, DropRecord

log = logging.getLogger("jetrl.buffer")

BUS_TROUBLE = (nats.errors.Error, asyncio.TimeoutError)
"""What forming or dropping a step meets when the bus is unavailable for a while (an election,
a lost connection): the buffer keeps what it holds and tries again."""


class Buffer:
    def __init__(self, rt: Runtime, batched: BatchedSoFar) -> None:
        self.rt = rt
        self.cfg = rt.config
        self.batched = batched
        self.groups: OrderedDict[str, Group] = OrderedDict()
        self.abandoned: dict[str, str] = {}
        """Prompt id -> reason, for groups dropped incomplete: a sample of one that comes later
        is rejected, not held as the start of a group that can never complete either."""
        self.lock = asyncio.Lock()
        self.unsettled = False
        self.step_kl: float | None = None
        """The KL of the step last formed (KL in reward), whence the next step's coefficient."""
        self.dropping: set[str] = set()
        """Groups whose drop began and did not finish (the bus failed): kept out of every step."""
        """A handler could not finish forming or dropping (the bus failed);
        `retry_unsettled` retries."""
        self.equal_drops = 0
        """Groups dropped for equal rewards while the step being formed forms (this process's
        count; -1 once past the cap), against `algorithm.max_regenerations`."""

    async def handle(self, event: Rewards, msg: Msg) -> Hold | None:
        # One sample's event, or a whole group's (`schemas.group_events`): held by sample, the
        # group's samples under its one message, acked or dropped together.
        todo = [r for r in event.each() if r.id not in self.batched.sample_ids]
        if not todo:
            return None  # a redelivery of samples already inside a stored batch
        async with self.lock:  # group state changes only under the lock
            for reward in todo:  # one that can never be batched refuses the event whole
                self.check(reward)
            held: dict[str, Group] = {}
            for reward in todo:
                t = reward.trajectory
                group = self.groups.setdefault(
                    t.prompt_id, Group(t.prompt_id, t.group_size, self.batched.next_step)
                )
                group.add(reward, msg)
                held[t.prompt_id] = group
            # The sample is held from here on: what fails now is the bus, not this sample, and
            # the worker must not nak a message a group holds (a later ack of it would fail,
            # half-way through acking a stored step). `retry_unsettled` tries again.
            try:
                await self.settle(list(held.values()))
            except BUS_TROUBLE as exc:
                self.unsettled = True
                log.warning("step %d not settled, retried shortly: %r", self.batched.next_step, exc)
        return HOLD

    async def refused(self, event: Rewards, reason: str) -> None:
        """A whole group's event the buffer refused (`check`) or gave up on, now in `dead`: its
        prompt is recorded as dropped (the gate issues another), and a sample of it that comes
        later is refused too. A sample's own event needs neither: its group waits, incomplete,
        until `drop_overdue` drops it."""
        if not isinstance(event, RewardGroupEvent):
            return
        self.abandoned[event.prompt_id] = reason
        record = DropRecord(
            kind=DropKind.REFUSED, reason=reason, samples=len(event.rewards), time=time.time()
        )
        with contextlib.suppress(KeyWrongLastSequenceError):  # recorded before a restart
            await self.rt.kv.create(drop_key(event.prompt_id), record.encode())

    async def settle(self, groups: list[Group]) -> None:
        """Drop those of `groups` that are complete and cannot be trained, then form every step
        the complete groups allow. Safe to call again after it failed part-way."""
        for group in groups:
            if (
                group.prompt_id in self.groups
                and group.complete
                and (
                    record := group.drop_record(self.drop_equal()) or self.advantage_problem(group)
                )
            ):
                # Out of every step until the drop is done: a drop record the bus stored
                # although its reply was lost must not meet the same group in a batch.
                self.dropping.add(group.prompt_id)
                await self.drop(group, record)
                self.dropping.discard(group.prompt_id)
                self.equal_drops += record.kind is DropKind.EQUAL
        await self.maybe_form_step()

    def drop_equal(self) -> bool:
        """Whether a group of equal rewards is dropped now: dynamic sampling on, and the step
        being formed not yet past `max_regenerations` x `prompts_per_step` such drops (past
        it, said once per step, equal groups are trained until the step forms)."""
        algo = self.cfg.algorithm
        if not algo.drop_equal_reward_groups:
            return False
        if not regenerations_left(algo.max_regenerations, algo.prompts_per_step, self.equal_drops):
            if self.equal_drops > 0:  # said once a step (max_regenerations 0: never)
                log.warning(
                    "step %d: %d groups dropped for equal rewards (algorithm.max_regenerations "
                    "%s x %d prompts): training equal-reward groups until the step forms",
                    self.batched.next_step,
                    self.equal_drops,
                    algo.max_regenerations,
                    algo.prompts_per_step,
                )
            self.equal_drops = -1  # reset when the step forms
            return False
        return True

    def check(self, reward: RewardEvent) -> None:
        """Reject a sample that could never go into a batch: held, it would block its group or
        fail every step that chose it, and the buffer would form no step again."""
        t = reward.trajectory
        if (reason := self.abandoned.get(t.prompt_id)) is not None:
            raise Reject(f"group {t.prompt_id} was dropped: {reason}")
        group = self.groups.get(t.prompt_id)
        if group is not None and group.size != t.group_size:
            raise Reject(f"group size {t.group_size}, but group {t.prompt_id} has {group.size}")
        # Versions count trainer steps and every step trained was formed here, so no rollout
        # can serve a version past the step being formed (one past it only while a step
        # stored in part is re-formed: a rank may have trained it).
        newest = int(t.trained_versions().max(initial=0))
        if newest > (limit := self.batched.next_step + (self.batched.partial is not None)):
            raise Reject(
                f"generated by weights v{newest}, but no version past v{limit} can exist yet"
            )
        if self.rt.topology.reference and reward.ref_logprobs is None:
            raise Reject(
                "no reference log-probs: the run has the reference stage, "
                "and this sample did not pass it"
            )
        per_token = bytes_per_token(self.rt.topology.reference, reward.turn_rewards is not None)
        if (unfit := row_too_long(t, per_token, self.rt.publisher.max_payload)) is not None:
            raise Reject(unfit)

    def advantages(self, groups: list[Group]) -> list[list[float]]:
        """One step's groups -> each group's [G] advantages in sample order (`step_advantages`)."""
        return self.step_advantages(groups)[0]

    def step_advantages(self, groups: list[Group]) -> tuple[list[list[float]], float | None]:
        """One step's groups -> each group's [G] advantages and the step's KL in the reward
        (`consumers.buffer_groups.step_advantages`, at this step's KL coefficient)."""
        return group_advantages(self.cfg, groups, self.batched.kl_coef)

    def advantage_problem(self, group: Group) -> DropRecord | None:
        """Why the group cannot be trained although each reward is finite (huge ones overflow, or
        the estimator refuses them: passk takes 0/1 rewards only)."""
        try:
            (adv,) = self.advantages([group])
        except ValueError as exc:
            reason = f"advantage {self.cfg.algorithm.advantage}: {exc}"
            return DropRecord(kind=DropKind.ADVANTAGE, reason=reason, samples=group.size)
        if all(np.isfinite(adv)):
            return None
        largest = max(abs(r.reward) for r, _ in group.samples.values())
        reason = f"advantages not finite (rewards up to {largest:g} in magnitude)"
        return DropRecord(kind=DropKind.ADVANTAGE, reason=reason, samples=group.size)

    async def drop(self, group: Group, record: DropRecord, *, dead: bool = False) -> None:
        """Record the drop in KV (the producer replaces the group), then ack its samples, or
        with `dead` store each in `dead` with the reason and terminate it."""
        reason = record.reason
        record = record.model_copy(update={"time": time.time()})
        try:
            await self.rt.kv.create(drop_key(group.prompt_id), record.encode())
        except KeyWrongLastSequenceError:
            pass  # dropped before a restart: recorded once
        del self.groups[group.prompt_id]
        stage = (
            self.rt.topology.buffer_input.work_queue.durable
        )  # the name the worker dead-letters under
        for reward, msg in group.samples.values():
            self.trace_outcome(reward, msg, reason=reason)
        for msg in group.messages():
            if dead:
                await dead_letter(self.rt.publisher, stage, msg, reason)
            with contextlib.suppress(MsgAlreadyAckdError):  # settled by an earlier try
                await (msg.term() if dead else msg.ack())

    async def drop_overdue(self) -> None:
        """Drop the groups still incomplete after more than `max_group_wait_steps` formed steps.

        Their samples go to `dead` (an operator should see a prompt that never completes: one
        never issued, or whose other samples were lost) and are terminated, so a restarted
        buffer does not get them back; a later sample of one is rejected (`check`).
        """
        limit, step = self.cfg.staleness.group_wait_steps, self.batched.next_step
        for group in [
            g for g in self.groups.values() if not g.complete and step - g.first_step > limit
        ]:
            reason = (
                f"incomplete: {len(group.samples)} of {group.size} samples after "
                f"{step - group.first_step} steps formed (max_group_wait_steps {limit})"
            )
            log.warning("dropping group %s: %s", group.prompt_id, reason)
            self.abandoned[group.prompt_id] = reason
            record = DropRecord(kind=DropKind.INCOMPLETE, reason=reason, samples=len(group.samples))
            await self.drop(group, record, dead=True)

    def trace_outcome(
        self, reward: RewardEvent, msg: Msg, *, step: int | None = None, reason: str | None = None
    ) -> str:
        """Record in the sample's own trace that it went into `step`, or was dropped for `reason`.

        The `outcome` span is a child of the reward's publish (from the message headers); its
        traceparent is what the batch carries, so the assemble-batch and train-step spans
        link to it. Returns that traceparent.
        """
        attributes: dict[str, str | int | bool] = {
            "jetrl.run": self.rt.topology.run,
            "jetrl.prompt_id": reward.trajectory.prompt_id,
            "jetrl.sample_id": reward.id,
            "jetrl.batched": reason is None,
        }
        if step is not None:
            attributes["jetrl.step"] = step
        if reason is not None:
            attributes["jetrl.drop_reason"] = reason
        span = tracing.tracer.start_span(
            "outcome", context=tracing.extract(msg.headers), attributes=attributes
        )
        span.end()
        metrics.count_samples("buffer", "batched" if reason is None else "dropped")
        return tracing.traceparent(span)

    async def maybe_form_step(self) -> None:
        per_step = self.cfg.algorithm.prompts_per_step
        while True:
            step = self.batched.next_step
            if self.batched.partial is not None:
                ids = self.batched.partial[1]
                if not all(pid in self.groups and self.groups[pid].complete for pid in ids):
                    return
                chosen = [self.groups[pid] for pid in ids]
            else:
                staleness = self.cfg.staleness
                complete = [g for g in self.groups.values() if g.complete]
                for group in [g for g in complete if staleness.too_old(g.min_version, step)]:
                    oldest_allowed = staleness.oldest_version(step)
                    reason = f"stale: version {group.min_version} < {oldest_allowed} at step {step}"
                    record = DropRecord(kind=DropKind.STALE, reason=reason, samples=group.size)
                    await self.drop(group, record)
                ready = [
                    g
                    for g in self.groups.values()
                    if g.complete and g.prompt_id not in self.dropping
                ]
                if len(ready) < per_step:
                    return
                chosen = ready[:per_step]
                # Until every micro-batch is stored the step is these groups, whatever happens:
                # a publish that fails part-way is retried with the same groups (the stored
                # micro-batches keep their ids, so the stream keeps one of each).
                self.batched.partial = (step, tuple(g.prompt_id for g in chosen))
            await self.publish_step(step, chosen)
            BUFFER_STEP_STORED(f"step {step}")
            for group in chosen:
                del self.groups[group.prompt_id]
                self.batched.sample_ids.update(reward.id for reward, _ in group.samples.values())
            self.batched.partial, self.batched.next_step = None, step + 1
            self.equal_drops = 0  # the next step may drop its own max_regenerations' worth
            self.batched.kl_coef = next_kl_coef(
                self.cfg.algorithm, self.batched.kl_coef, self.step_kl, sum(g.size for g in chosen)
            )
            # Acked once the step is settled here: a redelivery of one not acked (a failed ack,
            # a kill) is then recognised as batched and acked.
            for group in chosen:
                for msg in group.messages():
                    with contextlib.suppress(MsgAlreadyAckdError):
                        await msg.ack()
            await self.drop_overdue()  # steps formed are what a held group's wait is counted in

    async def publish_step(self, step: int, groups: list[Group]) -> None:
        rows: list[Row] = []
        advantages, self.step_kl = self.step_advantages(groups)
        in_reward = self.cfg.algorithm.kl_placement == "reward"
        for group, adv in zip(groups, advantages, strict=True):
            ordered = [group.samples[i] for i in range(group.size)]
            for (r, m), a in zip(ordered, adv, strict=True):  # a row per segment of each
                rows += Row.all_of(r, a, self.trace_outcome(r, m, step=step))
        tcfg = self.cfg.trainer
        packed = pack_step(rows, tcfg.dp_size, tcfg.micro_batch_tokens)
        step_groups = tuple(g.prompt_id for g in groups)
        episodes = episode_stats([r for g in groups for r, _ in g.samples.values()])
        # A trace of its own (an empty parent context): the step serves many prompts, and would
        # otherwise land in the trace of whichever sample happened to complete it.
        with tracing.tracer.start_as_current_span(
            "assemble batch",
            context=Context(),
            links=tracing.link_to([r.traceparent for r in rows]),
            attributes={
                "jetrl.step": step,
                "jetrl.run": self.rt.topology.run,
                "jetrl.samples": sum(g.size for g in groups),
                "jetrl.rows": len(rows),
            },
        ):
            acks = []
            for rank, micro_batches in enumerate(packed):
                for index, mb in enumerate(micro_batches):
                    event = BatchEvent(
                        id=f"{self.rt.topology.run}/step/{step}/{rank}/{index}",
                        run=self.rt.topology.run,
                        source=self.rt.source,
                        step=step,
                        dp_rank=rank,
                        dp_size=tcfg.dp_size,
                        micro_index=index,
                        micro_count=len(micro_batches),
                        input_ids=Tensor.from_numpy(mb.input_ids),
                        attention_mask=Tensor.from_numpy(mb.attention_mask),
                        loss_mask=Tensor.from_numpy(mb.loss_mask),
                        advantages=Tensor.from_numpy(mb.advantages),
                        behaviour_logprobs=Tensor.from_numpy(mb.behaviour_logprobs),
                        versions=Tensor.from_numpy(mb.versions),
                        rewards=Tensor.from_numpy(mb.rewards),
                        sample_ids=tuple(r.sample_id for r in mb.rows),
                        traceparents=tuple(r.traceparent for r in mb.rows),
                        step_prompt_ids=step_groups,
                        ref_logprobs=None
                        if mb.ref_logprobs is None
                        else Tensor.from_numpy(mb.ref_logprobs),
                        kl_coef=self.batched.kl_coef if in_reward else None,
                        kl_mean=self.step_kl,
                        token_rewards=Tensor.from_numpy(mb.token_rewards)
                        if mb.token_rewards is not None
                        else None,
                        **episodes,
                    )
                    acks.append(await self.rt.publisher.send(BATCHES, event, rank))
                    if len(acks) == 1 and BUFFER_MID_STEP in armed():
                        await acks[0]
                        BUFFER_MID_STEP(f"step {step}")
            await asyncio.gather(*acks)  # every micro-batch stored before any input is acked
        rewards = np.array([r.reward for r in rows])
        log.info(
            "step %d: %d groups, %d samples, mean reward %.3f",
            step,
            len(groups),
            len(rows),
            rewards.mean(),
        )

    async def retry_unsettled(self) -> None:
        """Settle what the bus did not let a handler settle (its samples stay held meanwhile:
        the worker's heartbeat keeps every HOLD message in progress)."""
        ack_wait = await consumer_ack_wait(
            self.rt.js, self.rt.topology, self.rt.topology.buffer_input
        )
        while True:
            await asyncio.sleep(ack_wait / 3)
            if self.unsettled:
                async with self.lock:
                    try:
                        await self.settle(list(self.groups.values()))
                        self.unsettled = False
                    except BUS_TROUBLE as exc:
                        log.warning("step %d still not settled: %r", self.batched.next_step, exc)


async def build(rt: Runtime) -> Stage[Rewards]:
    """The buffer stage: what the batch stream says first, then rewards served by
    `Buffer.handle`, beside the retry of what the bus did not let a handler settle."""
    buffer = Buffer(rt, await read_batches(rt))
    # Samples of several steps wait here unacked, so let many handlers be "in flight".
    options = WorkerOptions(concurrency=256, max_deliver=20)
    return Stage(
        rt.topology.buffer_input,
        buffer.handle,
        options,
        helpers={"retry unsettled steps": buffer.retry_unsettled},
        on_dead=buffer.refused,
    )


def main() -> None:
    run_stage("buffer", build, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
