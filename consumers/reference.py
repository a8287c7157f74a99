"""`python -m consumers.reference --run R [--nats URL]`: rewards in,
rewards with reference log-probs out (a whole group's as one event).

The stage between reward and buffer when the run has `reference.enabled` (verl's reference
workers): each scored sample's response is scored again, by the frozen initial model
(`engines.reference`), so the KL to it can go into the loss or the reward without the trainer
holding a second model, and scales with workers of its own.

    rewards (durable `reference`) -> token ids the model cannot take? -> Reject (to dead)
        -> queued (each segment of an episode split in samples, `TrajectoryEvent.segments`);
           up to `reference.batch` waiting sequences -> one forward pass (in a thread)
        -> RewardEvent + ref_logprobs [R] (and earlier_ref_logprobs, a segment's each) ->
           `scored` (same id: a re-publish is a duplicate the stream drops) -> ack

The scored event is stored before the reward is acked, so a worker killed at any moment loses
nothing: its rewards come back to another worker (or its replacement) and are scored again.
SIGTERM stops fetching, finishes what was fetched, and exits.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import torch
from nats.aio.msg import Msg

from bus import metrics, tracing
from bus.crashpoints import REFERENCE_MID_SCORING, REFERENCE_STORED_NOT_ACKED
from bus.runtime import CannotAttach, Runtime
from bus.stage import Stage, run_stage
from bus.topology import SCORED
from bus.worker import Handler, WorkerOptions
from consumers.checks import ModelLimits
from consumers.group_publish import store_rewards
from engines.device import resolve_device, torch_dtype
from engines.model_source import ModelNotFound, resolve_model_path
from engines.reference import ReferenceEngine
from schemas import RewardEvent, Rewards, Tensor

log = logging.getLogger("jetrl.reference")

Item = tuple[np.ndarray, np.ndarray, "asyncio.Future[np.ndarray]"]


class Batcher:
    """Samples waiting for the reference model, scored `batch` at a time in one forward pass."""

    def __init__(self, engine: ReferenceEngine, batch: int) -> None:
        self.engine, self.batch = engine, batch
        self.queue: asyncio.Queue[Item] = asyncio.Queue()

    async def score(self, prompt: np.ndarray, response: np.ndarray) -> np.ndarray:
        """[R] reference log-probs of `response` after `prompt`."""
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        await self.queue.put((prompt, response, future))
        return await future

    async def run(self) -> None:
        """The helper that runs the forward passes; a failed pass fails its samples' handlers
        (they are retried), never this loop."""
        while True:
            items = [await self.queue.get()]
            while len(items) < self.batch and not self.queue.empty():
                items.append(self.queue.get_nowait())
            try:
                scored = await asyncio.to_thread(
                    self.engine.logprobs, [(p, r) for p, r, _ in items]
                )
            except Exception as exc:  # noqa: BLE001 - handed to each waiting handler
                log.warning("reference forward of %d samples failed: %r", len(items), exc)
                for _, _, future in items:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, _, future), logprobs in zip(items, scored, strict=True):
                if not future.done():
                    future.set_result(logprobs)


def reference_handler(rt: Runtime, batcher: Batcher, limits: ModelLimits) -> Handler[Rewards]:
    """Score each sample's response (one, or a whole group's) under the reference model and
    store them on `scored`, a group's as one event (`schemas.group_events`)."""

    async def score(reward: RewardEvent) -> RewardEvent:
        t = reward.trajectory
        segments = t.segments()  # an episode split where its render stopped extending: several
        for s in segments:
            largest = int(max(s.prompt.max(initial=0), s.response.max(initial=0)))
            limits.check(largest, s.prompt.shape[0] + s.response.shape[0], f"sample {reward.id}")
        with tracing.tracer.start_as_current_span(
            "reference",
            attributes={
                "jetrl.prompt_id": t.prompt_id,
                "jetrl.sample_index": t.sample_index,
                "jetrl.worker": rt.source,
            },
        ):
            REFERENCE_MID_SCORING(reward.id)
            # Each segment is its own sequence (its own prompt), queued at once: one batch.
            scored_segments = await asyncio.gather(
                *(batcher.score(s.prompt, s.response) for s in segments)
            )
        *earlier, own = (Tensor.from_numpy(lp.astype(np.float32)) for lp in scored_segments)
        return RewardEvent.model_validate(
            {
                **dict(reward),
                "source": rt.source,
                "ref_logprobs": own,
                "earlier_ref_logprobs": tuple(earlier),
            }
        )

    async def handle(event: Rewards, _msg: Msg) -> None:
        # A group's samples are queued at once: they share forward passes.
        each = await asyncio.gather(*(score(r) for r in event.each()))
        await store_rewards(rt.publisher, SCORED, event, list(each), rt.source)
        REFERENCE_STORED_NOT_ACKED(event.id)
        metrics.count_samples("reference", "scored", len(each))

    return handle


async def build(rt: Runtime) -> Stage[Rewards]:
    """The reference stage: the frozen initial model (`model.path`) at the rollout's sampling
    temperature, in `model.dtype` on this worker's device, serving `rewards`."""
    cfg = rt.config
    if not cfg.reference.enabled:
        raise CannotAttach(
            f"run {rt.topology.run} has no reference stage (reference.enabled is false)"
        )
    torch.set_num_threads(1)  # the other workers share the node's cores with us
    try:
        device = resolve_device()
    except ValueError as exc:
        raise CannotAttach(str(exc)) from None
    try:  # a hub id: fetched or cached; a .gguf file: converted once (as rollout sees it)
        model_dir = await asyncio.to_thread(resolve_model_path, cfg.model.path, cfg.model.revision)
    except ModelNotFound as exc:
        raise CannotAttach(str(exc)) from None
    engine = await asyncio.to_thread(
        ReferenceEngine,
        model_dir,
        temperature=cfg.data.sampling.temperature,
        device=device,
        dtype=torch_dtype(cfg.model.dtype),
        chunk_tokens=cfg.trainer.logprob_chunk_tokens,
    )
    batcher = Batcher(engine, cfg.reference.batch)
    channel = rt.topology.served_by("reference")
    assert channel is not None  # the topology of a run with the stage has its work queue
    log.info("scoring run %s under the reference model on %s", rt.topology.run, device)
    rt.member.report(engine="reference")
    options = WorkerOptions(concurrency=cfg.reference.concurrency)
    return Stage(
        channel,
        reference_handler(rt, batcher, ModelLimits.of(engine.model)),
        options,
        helpers={"reference forward passes": batcher.run},
    )


def main() -> None:
    run_stage("reference", build, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    main()
