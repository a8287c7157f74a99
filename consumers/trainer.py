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
import time
from pathlib import Path

import numpy as np
import torch
from nats.js.api import ConsumerConfig, DeliverPolicy

from bus import tracing
from bus.dead import dead_letter
from bus.worker import stop_on_signals
from consumers.runtime import Runtime, attach, worker_args
from engines.protocols import MicroBatch
from engines.torch_train import LossConfig, TorchTrainEngine
from engines.weights import put_version
from schemas import BatchEvent, DecodeError, decode

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
    """What the producer's progress line and plots need from one step."""
    rewards = np.concatenate([b.rewards.numpy() for b in batches])
    versions = np.concatenate([b.versions.numpy()[b.loss_mask.numpy() == 1] for b in batches])
    return {
        "step": step,
        "time": time.time(),
        "train_seconds": seconds,
        "samples": int(rewards.size),
        "reward_mean": float(rewards.mean()),
        # Staleness of each token: the version being trained minus the version that made it.
        "staleness_max": int(step - versions.min()) if versions.size else 0,
        "staleness_hist": np.bincount(step - versions).tolist() if versions.size else [],
        "sample_ids": [sid for b in batches for sid in b.sample_ids],
        **trained,
    }


async def publish_weights(rt: Runtime, engine: TorchTrainEngine) -> None:
    event = await put_version(
        rt.js, rt.topology.object_bucket, rt.topology.run, rt.source, engine.step, engine.export_weights()
    )
    await rt.publisher.publish(rt.topology.subject("weights"), event)


async def main() -> None:
    args = worker_args("trainer", __doc__.splitlines()[0], with_rank=True)
    rank: int = args.rank
    rt = await attach("trainer", args.run, args.nats, args.replicas)
    # One thread: rollout and the other workers share the node's cores with us.
    torch.set_num_threads(1)
    cfg = rt.config
    algo = cfg.algorithm
    engine = TorchTrainEngine(
        Path(cfg.model.path or ""), lr=algo.lr, seed=cfg.trainer.seed,
        loss=LossConfig(eps_low=algo.clip_low, eps_high=algo.clip_high, tis_cap=algo.tis_cap,
                        temperature=cfg.data.sampling.temperature),
    )
    checkpoint = Path(cfg.trainer.checkpoint_dir) / f"rank{rank}.pt"
    state = engine.load_checkpoint(checkpoint) if checkpoint.exists() else {"last_seq": 0, "trained": []}
    if engine.step == 0 and rank == 0:
        await publish_weights(rt, engine)  # version 0: what every rollout worker starts from
    log.info("rank %d starts at step %d, batch sequence %d", rank, engine.step, state["last_seq"] + 1)
    rt.member.report(engine="torch", weight_version=engine.step)
    stop = asyncio.Event()
    stop_on_signals(stop)
    sub = await rt.js.subscribe(
        rt.topology.subject("batches", rank), ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=state["last_seq"] + 1),
    )
    pending: list[BatchEvent] = []
    while engine.step < cfg.trainer.steps and not stop.is_set():
        try:
            msg = await sub.next_msg(timeout=1.0)
        except TimeoutError:
            continue
        try:
            batch = decode(msg.data, BatchEvent)
        except DecodeError as exc:  # reading by position: record it, skip it, go on
            await dead_letter(rt.publisher, rt.topology, "trainer", msg, str(exc))
            continue
        if batch.step != engine.step:
            log.warning("batch %s is for step %d, expected %d: skipped", batch.id, batch.step, engine.step)
            continue
        pending.append(batch)
        if len(pending) < batch.micro_count:
            continue
        with tracing.tracer.start_as_current_span(
            "train step", links=tracing.link_to([tp for b in pending for tp in b.traceparents]),
            attributes={"jetrl.step": engine.step, "jetrl.run": rt.topology.run},
        ):
            started = time.perf_counter()
            trained = await asyncio.to_thread(engine.train_step, [micro_batch(b) for b in pending])
            metrics = step_metrics(engine.step - 1, pending, trained, time.perf_counter() - started)
        state = {"last_seq": msg.metadata.sequence.stream, "trained": state["trained"] + metrics["sample_ids"]}
        pending = []
        rt.member.report(weight_version=engine.step)
        if rank == 0 and engine.step % cfg.trainer.sync_every == 0:
            await publish_weights(rt, engine)
        if engine.step % cfg.trainer.checkpoint_every == 0 or engine.step == cfg.trainer.steps:
            await asyncio.to_thread(engine.save_checkpoint, checkpoint, state)
        await rt.kv.put(f"metrics.{rank}.{metrics['step']}", json.dumps(metrics).encode())
        log.info("step %d: reward %.3f loss %.4f", metrics["step"], metrics["reward_mean"], trained["loss"])
    await sub.unsubscribe()
    await rt.close()


if __name__ == "__main__":
    asyncio.run(main())
