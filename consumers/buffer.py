"""`python -m consumers.buffer --run R`: scored samples in, gradient-ready batches out.

The loop holds every RewardEvent *unacked* until the batch containing it is stored (the
stream is the state: a buffer that dies loses nothing, its inputs are redelivered).

    reward -> cannot ever be batched? -> Reject (to dead, with the reason)
        -> group by prompt id -> complete group?
        failed sample / all-equal rewards / non-finite advantages -> drop (KV
        `drop.<prompt id>` = reason), ack
        else -> ready
    ready groups >= prompts_per_step -> drop the too-stale ones, advantages, pack
        -> publish BatchEvents for step s -> ack the step's samples -> s + 1

A restarted buffer first reads the batch stream: sample ids already batched are acked and
skipped when redelivered, and a step it had only partly stored is re-formed from the
same groups (the batch events list them) and re-published (dedup absorbs the repeats).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from nats.aio.msg import Msg
from nats.js.errors import KeyWrongLastSequenceError
from opentelemetry.context import Context

from bus import metrics, tracing
from bus.worker import HOLD, Hold, Reject, Worker, WorkerOptions, consumer_ack_wait, stop_on_signals
from consumers.packing import BYTES_PER_TOKEN, Row, pack_step
from consumers.runtime import Runtime, attach, run_worker, worker_args
from engines.algorithms import advantages
from schemas import BatchEvent, DecodeError, RewardEvent, Tensor, decode

log = logging.getLogger("jetrl.buffer")

ESTIMATORS = {"grpo": advantages.grpo, "dr_grpo": advantages.dr_grpo, "rloo": advantages.rloo}


@dataclass
class Group:
    prompt_id: str
    size: int
    samples: dict[int, tuple[RewardEvent, Msg]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.samples) == self.size

    @property
    def min_version(self) -> int:
        return min(int(r.trajectory.versions.numpy().min(initial=1 << 30)) for r, _ in self.samples.values())

    def drop_reason(self, drop_equal: bool = True) -> str | None:
        """Why a complete group must not be trained: a failed sample, or (dynamic sampling,
        `drop_equal`) rewards that are all equal and so carry no advantage."""
        rewards = [r for r, _ in self.samples.values()]
        failed = [r for r in rewards if r.failed]
        if failed:
            return f"failed sample {failed[0].id}: {failed[0].reason}"
        if drop_equal and len({r.reward for r in rewards}) == 1:
            return f"all {len(rewards)} rewards equal ({rewards[0].reward:g})"
        return None


@dataclass
class BatchedSoFar:
    """What the batch stream says: sample ids batched, the next step, a half-stored step."""

    sample_ids: set[str] = field(default_factory=set)
    next_step: int = 0
    partial: tuple[int, tuple[str, ...]] | None = None


async def read_batches(rt: Runtime) -> BatchedSoFar:
    """Replay the batch stream once at start-up (an ordered consumer from the first message)."""
    seen = BatchedSoFar()
    info = await rt.js.stream_info(rt.topology.stream("batches"))
    if info.state.messages == 0:
        return seen
    counts: dict[tuple[int, int], tuple[int, int]] = {}  # (step, rank) -> (stored, micro_count)
    groups: dict[int, tuple[str, ...]] = {}
    sub = await rt.js.subscribe(rt.topology.subject("batches", ">"), ordered_consumer=True)
    for _ in range(info.state.messages):
        try:
            batch = decode((await sub.next_msg(timeout=10)).data, BatchEvent)
        except DecodeError:
            continue  # the trainer dead-letters unreadable batches; nothing of ours is in them
        seen.sample_ids.update(batch.sample_ids)
        stored, _ = counts.get((batch.step, batch.dp_rank), (0, batch.micro_count))
        counts[(batch.step, batch.dp_rank)] = (stored + 1, batch.micro_count)
        groups[batch.step] = batch.step_prompt_ids
    await sub.unsubscribe()
    if not counts:
        return seen
    last = max(step for step, _ in counts)
    seen.next_step = last + 1
    dp_size = rt.config.trainer.dp_size
    if any(counts.get((last, r), (0, 1))[0] < counts.get((last, r), (0, 1))[1] for r in range(dp_size)):
        seen.partial, seen.next_step = (last, groups[last]), last
    return seen


class Buffer:
    def __init__(self, rt: Runtime, batched: BatchedSoFar) -> None:
        self.rt = rt
        self.cfg = rt.config
        self.batched = batched
        self.groups: OrderedDict[str, Group] = OrderedDict()
        self.lock = asyncio.Lock()

    async def handle(self, reward: RewardEvent, msg: Msg) -> Hold | None:
        if reward.id in self.batched.sample_ids:
            return None  # a redelivery of a sample already inside a stored batch
        t = reward.trajectory
        async with self.lock:  # group state changes only under the lock
            self.check(reward)
            group = self.groups.setdefault(t.prompt_id, Group(t.prompt_id, t.group_size))
            group.samples[t.sample_index] = (reward, msg)  # a redelivery replaces the stale Msg
            drop_equal = self.cfg.algorithm.drop_equal_reward_groups
            if group.complete and (reason := group.drop_reason(drop_equal) or self.advantage_problem(group)):
                await self.drop(group, reason)
            await self.maybe_form_step()
        return HOLD

    def check(self, reward: RewardEvent) -> None:
        """Reject a sample that could never go into a batch: held, it would block its group or
        fail every step that chose it, and the buffer would form no step again."""
        t = reward.trajectory
        group = self.groups.get(t.prompt_id)
        if group is not None and group.size != t.group_size:
            raise Reject(f"group size {t.group_size}, but group {t.prompt_id} has {group.size}")
        # Versions count trainer steps and every step trained was formed here, so no rollout
        # can serve a version past the step being formed (one past it only while a step
        # stored in part is re-formed: a rank may have trained it).
        newest = int(t.versions.numpy().max(initial=0))
        if newest > (limit := self.batched.next_step + (self.batched.partial is not None)):
            raise Reject(f"generated by weights v{newest}, but no version past v{limit} can exist yet")
        # Half the max payload: the other half is for the ids a batch event carries.
        tokens = t.prompt_ids.shape[0] + t.response_ids.shape[0]
        if tokens * BYTES_PER_TOKEN > self.rt.publisher.max_payload // 2:
            raise Reject(f"a row of {tokens} tokens cannot fit one batch event")

    def advantages(self, group: Group) -> list[float]:
        """[G] rewards -> [G] advantages, one per sequence of the group, in sample order."""
        rewards = torch.tensor([group.samples[i][0].reward for i in range(group.size)], dtype=torch.float32)
        return ESTIMATORS[self.cfg.algorithm.advantage](rewards).tolist()

    def advantage_problem(self, group: Group) -> str | None:
        """Why the group cannot be trained although each reward is finite (huge ones overflow)."""
        if all(np.isfinite(self.advantages(group))):
            return None
        largest = max(abs(r.reward) for r, _ in group.samples.values())
        return f"advantages not finite (rewards up to {largest:g} in magnitude)"

    async def drop(self, group: Group, reason: str) -> None:
        """Record the drop in KV (the producer replaces the group), then ack its samples."""
        try:
            await self.rt.kv.create(f"drop.{group.prompt_id}", reason.encode())
        except KeyWrongLastSequenceError:
            pass  # dropped before a restart: recorded once
        del self.groups[group.prompt_id]
        for reward, msg in group.samples.values():
            self.admit(reward, msg, reason=reason)
            await msg.ack()

    def admit(self, reward: RewardEvent, msg: Msg, *, step: int | None = None, reason: str | None = None) -> str:
        """Record in the sample's own trace that it went into `step`, or was dropped for `reason`.

        The `admit` span is a child of the reward's publish (from the message headers); its
        traceparent is what the batch carries, so the assemble-batch and train-step spans
        link to it. Returns that traceparent.
        """
        attributes: dict[str, str | int | bool] = {
            "jetrl.run": self.rt.topology.run, "jetrl.prompt_id": reward.trajectory.prompt_id,
            "jetrl.sample_id": reward.id, "jetrl.admitted": reason is None,
        }
        if step is not None:
            attributes["jetrl.step"] = step
        if reason is not None:
            attributes["jetrl.drop_reason"] = reason
        span = tracing.tracer.start_span("admit", context=tracing.extract(msg.headers), attributes=attributes)
        span.end()
        metrics.count_samples("buffer", "admitted" if reason is None else "dropped")
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
                oldest_allowed = step - self.cfg.algorithm.max_staleness
                for group in [g for g in self.groups.values() if g.complete and g.min_version < oldest_allowed]:
                    await self.drop(group, f"stale: version {group.min_version} < {oldest_allowed} at step {step}")
                ready = [g for g in self.groups.values() if g.complete]
                if len(ready) < per_step:
                    return
                chosen = ready[:per_step]
            await self.publish_step(step, chosen)
            for group in chosen:
                del self.groups[group.prompt_id]
                for reward, msg in group.samples.values():
                    self.batched.sample_ids.add(reward.id)
                    await msg.ack()
            self.batched.partial, self.batched.next_step = None, step + 1

    async def publish_step(self, step: int, groups: list[Group]) -> None:
        rows: list[Row] = []
        for group in groups:
            ordered = [group.samples[i] for i in range(group.size)]
            adv = self.advantages(group)
            rows += [Row.of(r, a, self.admit(r, m, step=step)) for (r, m), a in zip(ordered, adv)]
        tcfg = self.cfg.trainer
        packed = pack_step(rows, tcfg.dp_size, tcfg.micro_batch_tokens)
        step_groups = tuple(g.prompt_id for g in groups)
        # A trace of its own (an empty parent context): the step serves many prompts, and would
        # otherwise land in the trace of whichever sample happened to complete it.
        with tracing.tracer.start_as_current_span(
            "assemble batch", context=Context(), links=tracing.link_to([r.traceparent for r in rows]),
            attributes={"jetrl.step": step, "jetrl.run": self.rt.topology.run, "jetrl.samples": len(rows)},
        ):
            acks = []
            for rank, micro_batches in enumerate(packed):
                for index, mb in enumerate(micro_batches):
                    event = BatchEvent(
                        id=f"{self.rt.topology.run}/step/{step}/{rank}/{index}", run=self.rt.topology.run,
                        source=self.rt.source, step=step, dp_rank=rank, dp_size=tcfg.dp_size,
                        micro_index=index, micro_count=len(micro_batches),
                        input_ids=Tensor.from_numpy(mb.input_ids), attention_mask=Tensor.from_numpy(mb.attention_mask),
                        loss_mask=Tensor.from_numpy(mb.loss_mask), advantages=Tensor.from_numpy(mb.advantages),
                        behaviour_logprobs=Tensor.from_numpy(mb.behaviour_logprobs),
                        versions=Tensor.from_numpy(mb.versions), rewards=Tensor.from_numpy(mb.rewards),
                        sample_ids=tuple(r.sample_id for r in mb.rows),
                        traceparents=tuple(r.traceparent for r in mb.rows), step_prompt_ids=step_groups,
                    )
                    acks.append(await self.rt.publisher.send(self.rt.topology.subject("batches", rank), event))
            await asyncio.gather(*acks)  # every micro-batch stored before any input is acked
        rewards = np.array([r.reward for r in rows])
        log.info("step %d: %d groups, %d samples, mean reward %.3f", step, len(groups), len(rows), rewards.mean())

    async def heartbeat(self) -> None:
        """Held samples stay ours: tell the server before their ack_wait runs out."""
        ack_wait = await consumer_ack_wait(self.rt.js, self.rt.topology, self.rt.topology.queues["buffer"])
        while True:
            await asyncio.sleep(ack_wait / 3)
            for group in list(self.groups.values()):
                for _, msg in list(group.samples.values()):
                    await msg.in_progress()


async def main() -> None:
    args = worker_args("buffer", __doc__.splitlines()[0])
    rt = await attach("buffer", args.run, args.nats, args.replicas)
    buffer = Buffer(rt, await read_batches(rt))
    stop = asyncio.Event()
    stop_on_signals(stop)
    heartbeat = asyncio.create_task(buffer.heartbeat())
    # Samples of several steps wait here unacked, so let many handlers be "in flight".
    options = WorkerOptions(concurrency=256, max_deliver=20)
    worker = Worker(rt.js, rt.topology, rt.topology.queues["buffer"], RewardEvent, buffer.handle, rt.publisher, options)
    await worker.run(stop)
    heartbeat.cancel()
    await rt.close()


if __name__ == "__main__":
    run_worker("buffer", main())
