"""`python -m consumers.trainer --run R [--rank K]`: batches in, optimizer steps and weights out.

The trainer reads its rank's batches *by position*, not by ack: its checkpoint records the
stream sequence of the last batch trained on, and a restart reads from the next one.

    for each step: collect micro_count micro-batches of step s -> train_step
        -> KV metrics.<s>, trainer.step
        -> every sync_every: weights v = s + 1 to the object store, WeightVersionEvent
        -> every checkpoint_every: model, optimizer, RNG, last sequence, trained sample ids
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from bus import tracing
from bus.dead import dead_letter
from bus.metrics import STALENESS, TRAIN_STEP_SECONDS, count_samples
from bus.topology import BATCHES, WEIGHTS, metrics_key
from bus.worker import Reject, stop_on_signals
from consumers.checks import ModelLimits
from consumers.crashpoints import TRAINER_METRICS_WRITTEN, TRAINER_MID_CHECKPOINT, TRAINER_MID_STEP
from consumers.runtime import Runtime, attach, run_worker, worker_args
from consumers.trainer_loggers import scalars, step_loggers
from engines.protocols import MicroBatch
from engines.torch_train import LossConfig, TorchTrainEngine
from engines.weights import put_version
from schemas import BatchEvent, DecodeError, decode
from schemas.config import RunConfig

log = logging.getLogger("jetrl.trainer")


def micro_batch(batch: BatchEvent) -> MicroBatch:
    return MicroBatch(
        input_ids=batch.input_ids.torch().long(),
        attention_mask=batch.attention_mask.torch().long(),
        loss_mask=batch.loss_mask.torch().float(),
        advantages=batch.advantages.torch(),
        behaviour_logprobs=batch.behaviour_logprobs.torch(),
    )


def step_metrics(step: int, batches: list[BatchEvent], trained: dict[str, float], seconds: float) -> dict:
    """What the producer's progress line and plots need from one step (`batches` may be empty:
    a step whose every micro-batch was refused)."""
    rewards = np.concatenate([np.zeros(0, np.float32), *(b.rewards.numpy() for b in batches)])
    versions = np.concatenate([np.zeros(0, np.int32), *(b.versions.numpy()[b.loss_mask.numpy() == 1] for b in batches)])
    return {
        "step": step,
        "time": time.time(),
        "train_seconds": seconds,
        "samples": int(rewards.size),
        "reward_mean": float(rewards.mean()) if rewards.size else math.nan,
        # Staleness of each token: the version being trained minus the version that made it.
        "staleness_max": int(step - versions.min()) if versions.size else 0,
        "staleness_hist": np.bincount(step - versions).tolist() if versions.size else [],
        "sample_ids": [sid for b in batches for sid in b.sample_ids],
        # Not the engine's "step" (the float count *after* the step): it overwrote the index
        # above, so the KV key read `metrics.0.1.0` for step 0 and every reader was off by one.
        **{name: value for name, value in trained.items() if name != "step"},
    }


def record_step(step: int, batches: list[BatchEvent], seconds: float) -> None:
    """OpenTelemetry metrics of one step: its duration, its samples, and each sample's staleness."""
    TRAIN_STEP_SECONDS.record(seconds)
    count_samples("trainer", "trained", sum(len(b.sample_ids) for b in batches))
    for b in batches:
        # A sample's staleness: the step minus the oldest version among its loss tokens.
        oldest = np.where(b.loss_mask.numpy() == 1, b.versions.numpy(), step).min(axis=1)
        for staleness in (step - oldest).tolist():
            STALENESS.record(staleness)


def admit(batch: BatchEvent, step: int, rank: int, collected: list[BatchEvent]) -> BatchEvent:
    """`batch` if it is a micro-batch of the step being collected, else Reject: a batch for
    another step or rank, or one that clashes with those `collected` (a repeated index, another
    count). Reading by position, the trainer cannot nak: what it rejects goes to `dead`."""
    if (batch.step, batch.dp_rank) != (step, rank):
        raise Reject(
            f"batch {batch.id} is for step {batch.step} rank {batch.dp_rank}, expected step {step} rank {rank}"
        )
    if collected and (
        batch.micro_count != collected[0].micro_count or batch.micro_index in {b.micro_index for b in collected}
    ):
        raise Reject(
            f"batch {batch.id}: micro-batch {batch.micro_index} of {batch.micro_count} clashes with the "
            f"{len(collected)} collected of {collected[0].micro_count}"
        )
    return batch


def loss_config(cfg: RunConfig) -> LossConfig:
    """The engine's loss settings from the run config: the policy loss, aggregation, clip
    range and TIS cap of `algorithm`, and the rollout's sampling temperature (behaviour
    log-probs were taken at it, so the trainer's must be too)."""
    algo = cfg.algorithm
    return LossConfig(
        policy_loss=algo.policy_loss, eps_low=algo.clip_low, eps_high=algo.clip_high,
        aggregation=algo.loss_aggregation, tis_cap=algo.tis_cap, temperature=cfg.data.sampling.temperature,
    )


async def publish_weights(rt: Runtime, engine: TorchTrainEngine) -> None:
    with tracing.tracer.start_as_current_span(
        "publish weights", attributes={"jetrl.weight_version": engine.step, "jetrl.run": rt.topology.run}
    ):
        event = await put_version(
            rt.js, rt.topology.object_bucket, rt.topology.run, rt.source, engine.step, engine.export_weights()
        )
        await rt.publisher.publish(WEIGHTS, event)


async def main() -> None:
    args = worker_args("trainer", __doc__.splitlines()[0], with_rank=True)
    rank: int = args.rank
    rt = await attach("trainer", args.run, args.nats, args.replicas)
    # One thread: rollout and the other workers share the node's cores with us.
    torch.set_num_threads(1)
    cfg = rt.config
    engine = TorchTrainEngine(Path(cfg.model.path or ""), lr=cfg.algorithm.lr, seed=cfg.trainer.seed, loss=loss_config(cfg))
    limits = ModelLimits.of(engine.model)
    checkpoint = Path(cfg.trainer.checkpoint_dir) / f"rank{rank}.pt"
    loggers = step_loggers(cfg) if rank == 0 else []
    state = engine.load_checkpoint(checkpoint) if checkpoint.exists() else {"last_seq": 0, "trained": []}
    if engine.step == 0 and rank == 0:
        await publish_weights(rt, engine)  # version 0: what every rollout worker starts from
    log.info("rank %d starts at step %d, batch sequence %d", rank, engine.step, state["last_seq"] + 1)
    rt.member.report(engine="torch", weight_version=engine.step)
    stop = asyncio.Event()
    stop_on_signals(stop)
    sub = await rt.js.subscribe(
        rt.topology.subject(BATCHES, rank), ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=state["last_seq"] + 1),
    )
    pending: list[BatchEvent] = []  # micro-batches of the step to train on
    refused: list[BatchEvent] = []  # micro-batches of the step the model cannot take

    async def skip(msg: Msg, reason: Exception) -> None:
        log.warning("batch at sequence %d skipped: %s", msg.metadata.sequence.stream, reason)
        await dead_letter(rt.publisher, "trainer", msg, str(reason))

    while engine.step < cfg.trainer.steps and not stop.is_set():
        try:
            msg = await sub.next_msg(timeout=1.0)
        except TimeoutError:
            continue
        try:
            batch = admit(decode(msg.data, BatchEvent), engine.step, rank, [*pending, *refused])
        except (DecodeError, Reject) as exc:  # reading by position: record it, skip it, go on
            await skip(msg, exc)
            continue
        try:
            limits.check(int(batch.input_ids.numpy().max()), batch.input_ids.shape[1], f"batch {batch.id}")
            pending.append(batch)
        except Reject as exc:
            # Still counted toward its step, which trains on the others (or on nothing): waiting
            # for it would stall the trainer, and every later step would then be rejected.
            await skip(msg, exc)
            refused.append(batch)
        if len(pending) + len(refused) < batch.micro_count:
            continue
        with tracing.tracer.start_as_current_span(
            "train step", links=tracing.link_to([tp for b in pending for tp in b.traceparents]),
            attributes={"jetrl.step": engine.step, "jetrl.run": rt.topology.run},
        ) as span:
            started = time.perf_counter()
            trained = await asyncio.to_thread(engine.train_step, [micro_batch(b) for b in pending])
            TRAINER_MID_STEP(f"step {engine.step - 1}")
            metrics = step_metrics(engine.step - 1, pending, trained, time.perf_counter() - started)
            # The version this step's update makes; it goes out now, or with a later sync.
            span.set_attribute("jetrl.weight_version", engine.step)
            if rank == 0 and engine.step % cfg.trainer.sync_every == 0:
                await publish_weights(rt, engine)  # in the step's trace: what it trained on -> what it made
        record_step(metrics["step"], pending, metrics["train_seconds"])
        state = {"last_seq": msg.metadata.sequence.stream, "trained": state["trained"] + metrics["sample_ids"]}
        pending, refused = [], []
        rt.member.report(weight_version=engine.step)
        # Metrics before the checkpoint: a trainer killed between the two restarts from this
        # checkpoint and never trains this step again, so metrics put after it could be lost
        # for good, and the producer waits for every step's metrics (ops.chaos). Put before,
        # a kill makes the restarted trainer retrain the step and put them again.
        await rt.kv.put(metrics_key(rank, metrics["step"]), json.dumps(metrics).encode())
        TRAINER_METRICS_WRITTEN(f"step {metrics['step']}")
        if engine.step % cfg.trainer.checkpoint_every == 0 or engine.step == cfg.trainer.steps:
            await asyncio.to_thread(
                engine.save_checkpoint, checkpoint, state, lambda: TRAINER_MID_CHECKPOINT(f"after step {metrics['step']}")
            )
        for logger in loggers:
            logger.log(metrics["step"], scalars(metrics))
        log.info("step %d: reward %.3f loss %.4f", metrics["step"], metrics["reward_mean"], trained["loss"])
    await sub.unsubscribe()
    for logger in loggers:
        logger.close()
    await rt.close()


if __name__ == "__main__":
    run_worker("trainer", main())
