"""`python -m consumers.trainer --run R [--rank K]`: batches in, optimizer steps and weights out.

The trainer reads its rank's batches *by position*, not by ack: its checkpoint records the
stream sequence of the last batch trained on, and a restart reads from the next one.
`Trainer` is the recipe, one method per step of it:

    setup       load the checkpoint (or publish weights v0), subscribe from the next sequence
    for each step s:
      collect   micro_count micro-batches of step s (refused ones dead-lettered, still counted);
                `lend: true`: waiting longer than trainer.lend_after lends the device to rollout,
                handed back between two tokens when the last one comes (`consumers.lending`)
      train     train_step -> metrics; every sync_every: this rank's weights (the engine's
                `export_own_weights`) as v = s + 1 to the weights sender
                (`consumers.weights.sender`: full or a delta, stored, announced as a
                WeightVersionEvent, in the step's trace)
      record    KV metrics.<rank>.<s> (the step's sample ids with them), step loggers
      checkpoint  every checkpoint_every: model, optimizer, RNG, last sequence, and the update
                history as a hash chain (constant size: `consumers.update_history`); once it is
                committed (every rank's part), the batches of batches.<rank> before the
                checkpoint's last step are deleted (`trim`): no restart can need them

With `trainer.engine: fsdp` each of the `dp_size` ranks is one such process, `--rank K`: they
meet first (`consumers.trainer_dist`), then train, publish and checkpoint together, each on
its own `batches.<rank>`. With megatron at tensor parallel tp, the tp ranks meet the same way
and all read `batches.0` (one model copy cut in tp); rank 0 gathers and publishes each
version. With several fsdp ranks each rank hands the sender its own shard of a version (its
tensors gathered to it alone): each stores it, rank 0 announces the version; collective: the
same shards are stored as the fallback copy, then every rank broadcasts its own tensors to
the rollout workers (rank 0 coordinating).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import torch

from bus import tracing
from bus.crashpoints import (
    TRAINER_METRICS_WRITTEN,
    TRAINER_MID_CHECKPOINT,
    TRAINER_MID_STEP,
)
from bus.election import TRANSIENT, ride_out
from bus.readers import ByPosition, Poison
from bus.runtime import CannotAttach, Runtime
from bus.stage import Stage, run_stage
from bus.topology import BATCHES, metrics_key
from bus.worker import Reject
from consumers.checks import ModelLimits
from consumers.colocation import OptimizerTurns, Phases
from consumers.lending import Lender
from consumers.trainer_dist import RankGroup, configured_engine, exchange, join, leave, watch
from consumers.trainer_loggers import scalars, step_loggers
from consumers.trainer_start import last_stored_step, start_line
from consumers.trainer_steps import loss_config, micro_batch, record_step, step_metrics, take_batch
from consumers.update_history import UpdateHistory
from consumers.weights.sender import WeightsSender, alone
from engines.device import resolve_device
from engines.model_source import ModelNotFound, resolve_model_path
from engines.protocols import ReleasableTrainEngine
from schemas import BatchEvent
from schemas.kv_records import Phase, StepMetrics
from schemas.streams_config import batches_kept_from

log = logging.getLogger("jetrl.trainer")


class Trainer:
    """One trainer rank, as a recipe: `setup`, then `collect` -> `train` -> `record` ->
    `checkpoint` for each step; `run` is that loop."""

    def __init__(
        self,
        rt: Runtime,
        rank: int,
        group: RankGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        """`group`: this rank's process group (`consumers.trainer_dist.join`; fsdp); `device`:
        where the engine computes (default `engines.device.resolve_device()`)."""
        self.rt, self.rank, self.cfg = rt, rank, rt.config
        self.dp_rank = rank // self.cfg.trainer.copy_size
        """Which `batches.<dp_rank>` this rank reads: the tensor- and pipeline-parallel ranks of one
        model copy (megatron) read the same micro-batches; the first of them records the step's
        metrics (at pipeline parallel the engine hands it the last stage's, which hold the loss)."""
        self.records = rank % self.cfg.trainer.copy_size == 0
        self.group = group or RankGroup(rank, 1)
        self.engine = configured_engine(self.cfg, loss_config(self.cfg), device or resolve_device())
        self.limits = ModelLimits(*self.engine.token_limits())
        # fsdp: one checkpoint of every rank's shards; torch: one file per rank.
        name = f"{self.engine.name}.pt" if self.engine.collective else f"rank{rank}.pt"
        self.checkpoint_path = Path(self.cfg.trainer.checkpoint_dir) / name
        self.loggers = step_loggers(self.cfg) if rank == 0 else []
        self.last_seq = 0
        """Stream sequence of the last batch the model holds (trained on,
        or refused in a trained step)."""
        self.history = UpdateHistory()
        self.batches: ByPosition[BatchEvent] | None = None
        self.phases: Phases | None = None
        """`placement: colocated`: this rank's turns on the node's device
        (`consumers.colocation`)."""
        self.lender: Lender | None = None
        """`lend: true`: the rollout this trainer runs on its device while it waits for its
        batches (`consumers.lending`)."""
        shards = self.engine.weight_shards
        self.weights = WeightsSender.of(rt, rank, shards, exchange if shards > 1 else alone)
        """Full or delta versions (`weights.delta`), in shards when every rank sends one, or
        broadcasts."""

    async def setup(self) -> None:
        """Resume from the checkpoint, or publish version 0 (what every rollout worker starts
        from); then read this rank's batches from the one after the last the model holds."""
        checkpointed = self.engine.has_checkpoint(self.checkpoint_path)
        if checkpointed:
            state = self.engine.load_checkpoint(self.checkpoint_path)
            self.last_seq, self.history = (
                state["last_seq"],
                UpdateHistory.from_dict(state["history"]),
            )
        else:
            await self.sync_weights()
        stored = await last_stored_step(self.rt, self.dp_rank)
        log.info(start_line(self.rank, self.engine.step, checkpointed, stored, self.last_seq + 1))
        self.rt.member.report(engine=self.engine.name, weight_version=self.engine.step)
        # What is no batch goes to dead.trainer and is skipped: reading by position, there is
        # nothing to nak, and waiting on it would stall every later step.
        self.batches = ByPosition(
            self.rt.js,
            self.rt.topology,
            BATCHES,
            Poison("trainer", self.rt.publisher),
            start_seq=self.last_seq + 1,
            token=self.dp_rank,
        )
        await self.batches.open()

    async def collect(self, stop: asyncio.Event) -> tuple[list[BatchEvent], int] | None:
        """The micro-batches of step `engine.step` the model can take, and the sequence of the
        step's last one; None if `stop` comes first.

        A micro-batch the model cannot take is dead-lettered and still counted toward its step,
        which trains on the others (or on nothing): waiting for it would stall the trainer, and
        every later step would then be refused."""
        assert self.batches is not None, "setup() first"
        taken: list[BatchEvent] = []
        refused: list[BatchEvent] = []
        lender, started = self.lender, time.monotonic()
        while not stop.is_set():
            # Lending (`lend: true`): woken in time to lend once `trainer.lend_after` has passed.
            timeout = 1.0
            if lender is not None and not lender.lending:
                timeout = min(timeout, max(0.01, started + lender.lend_after - time.monotonic()))
            try:  # what is no batch the reader dead-letters and skips
                stored = await self.batches.next(timeout=timeout)
            except TimeoutError:
                if lender is not None:
                    await lender.maybe_lend(time.monotonic() - started)
                continue
            try:
                batch = take_batch(stored.event, self.engine.step, self.dp_rank, [*taken, *refused])
            except Reject as exc:  # reading by position: record it, skip it, go on
                await self.batches.refuse(stored, str(exc))
                continue
            try:
                self.limits.check(
                    int(batch.input_ids.numpy().max()),
                    batch.input_ids.shape[1],
                    f"batch {batch.id}",
                )
                taken.append(batch)
            except Reject as exc:
                await self.batches.refuse(stored, str(exc))
                refused.append(batch)
            if len(taken) + len(refused) == batch.micro_count:
                if lender is not None:  # the device back before the step trains
                    await lender.hand_back(arrived=time.perf_counter())
                return taken, stored.seq
        if lender is not None:
            await lender.hand_back(arrived=time.perf_counter())
        return None

    async def train(self, batches: list[BatchEvent]) -> dict[str, Any]:
        """One optimizer step on `batches` (in a thread: the event loop keeps serving the bus);
        weights out if a sync is due. Returns the step's metrics."""
        step = self.engine.step
        with tracing.tracer.start_as_current_span(
            "train step",
            links=tracing.link_to([tp for b in batches for tp in b.traceparents]),
            attributes={"jetrl.step": step, "jetrl.run": self.rt.topology.run},
        ) as span:
            started = time.perf_counter()
            trained = await asyncio.to_thread(
                self.engine.train_step, [micro_batch(b) for b in batches]
            )
            if per_token := self.cfg.trainer.simulated_seconds_per_token:  # on top of the real step
                await asyncio.sleep(
                    per_token * sum(int(b.attention_mask.numpy().sum()) for b in batches)
                )
            TRAINER_MID_STEP(f"step {step}")
            metrics = step_metrics(step, batches, trained, time.perf_counter() - started)
            # The version this step's update makes; it goes out now, or with a later sync.
            span.set_attribute("jetrl.weight_version", self.engine.step)
            if self.engine.step % self.cfg.trainer.sync_every == 0:
                await self.sync_weights()  # in the step's trace: what it trained on -> what it made
        record_step(step, batches, metrics["train_seconds"])
        return metrics

    async def sync_weights(self) -> None:
        """The weights as version `engine.step`, to the weights sender: this rank's part
        (`export_own_weights`, in a thread: the event loop keeps serving the bus), which it
        stores and rank 0 announces. The ranks of a collective engine all take part."""
        if self.rank == 0 or self.engine.collective:
            tensors = await asyncio.to_thread(self.engine.export_own_weights)
            await self.weights.send(self.engine.step, tensors)
            if self.lender is not None:  # the freshest weights, for the lent rollout
                self.lender.offer(tensors, self.engine.step)

    def done(self) -> bool:
        """Whether the run's last step is trained."""
        return self.engine.step >= self.cfg.trainer.steps

    async def record(self, metrics: dict[str, Any]) -> None:
        """The step's metrics to KV (the producer and the audit read them) and the loggers.

        Before the checkpoint: a trainer killed between the two restarts from this checkpoint
        and never trains this step again, so metrics put after it could be lost for good, and
        the producer waits for every step's metrics. Put before, a kill makes the restarted
        trainer retrain the step and put them again (the same batches, so the same ids)."""
        self.rt.member.report(weight_version=self.engine.step)
        if self.records:
            record = StepMetrics.from_flat(metrics)
            await self.rt.kv.put(metrics_key(self.dp_rank, record.step), record.encode())
            TRAINER_METRICS_WRITTEN(f"step {metrics['step']}")
        for logger in self.loggers:
            logger.log(metrics["step"], scalars(metrics))
        log.info(
            "step %d: reward %.3f loss %.4f",
            metrics["step"],
            metrics["reward_mean"],
            metrics["loss"],
        )

    async def checkpoint(self, last_seq: int, sample_ids: list[str]) -> None:
        """Note the step in the resume state; write it if a checkpoint is due (or the run ends),
        then trim the batches no restart from it can need."""
        before_last_step = self.last_seq
        self.last_seq, self.history = last_seq, self.history.after_step(sample_ids)
        step = self.engine.step
        if step % self.cfg.trainer.checkpoint_every and step != self.cfg.trainer.steps:
            return
        state = {"last_seq": self.last_seq, "history": self.history.as_dict()}
        # Returns on every rank once the checkpoint is committed (collective engines: rank 0's
        # commit, then a barrier), so no rank trims what the checkpoint before still needs.
        await asyncio.to_thread(
            self.engine.save_checkpoint,
            self.checkpoint_path,
            state,
            lambda: TRAINER_MID_CHECKPOINT(f"after step {step - 1}"),
        )
        # The run's last checkpoint trims nothing: the stream grows no more, and its last
        # interval stays for audit and replay. The tensor-parallel ranks of one copy share
        # batches.<dp_rank>: one of them trims.
        if self.records and not self.done():
            await self.trim(batches_kept_from(before_last_step))

    async def trim(self, keep_from: int) -> None:
        """Delete the messages of this rank's batch subject stored before sequence `keep_from`.
        Not done now (the bus is away past an election): the next checkpoint's trim covers it."""
        if keep_from <= 1:
            return
        topology = self.rt.topology
        try:
            await ride_out(
                lambda: self.rt.js.purge_stream(
                    topology.stream(BATCHES),
                    subject=topology.subject(BATCHES, self.dp_rank),
                    seq=keep_from,
                ),
                f"trimming batches.{self.dp_rank}",
            )
        except TRANSIENT as exc:
            log.warning(
                "batches.%d before sequence %d not trimmed now (%r): the next checkpoint does",
                self.dp_rank,
                keep_from,
                exc,
            )
            return
        log.info(
            "batches.%d: deleted what is stored before sequence %d (no restart needs it)",
            self.dp_rank,
            keep_from,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Set up, then train step after step until the run's last step or `stop`. Colocated
        (`phases`), setup and each step from train to checkpoint hold the node's device;
        collecting the next step's batches does not. With `trainer.offload_optimizer` each
        `leave` moves the optimizer state off the device (after the checkpoint, and after a
        restore in setup) and each `enter` brings it back (`consumers.colocation
        .OptimizerTurns`)."""
        phases = self.phases
        if phases is not None:
            await phases.enter()
        await self.setup()
        while not self.done() and not stop.is_set():
            if phases is not None:
                await phases.leave()
            collected = await self.collect(stop)
            if collected is None:
                break
            batches, last_seq = collected
            if phases is not None:
                await phases.enter()
            metrics = await self.train(batches)
            await self.record(metrics)
            for logger in self.loggers:  # wandb: a table of some of the step's samples
                logger.samples(metrics["step"], batches)
            await self.checkpoint(last_seq, metrics["sample_ids"])
        if phases is not None:
            await phases.leave()

    async def close(self) -> None:
        if self.phases is not None:
            await self.phases.leave()
        if self.lender is not None:
            await self.lender.close()
        if self.batches is not None:
            await self.batches.close()
        await self.weights.close()
        for logger in self.loggers:
            logger.close()
        leave(self.group)


async def build(rt: Runtime) -> Stage[Any]:
    """The trainer stage: no work queue (it reads its rank's batches by position), its steps
    as the stage's loop; the process exits 0 once the run's last step is trained."""
    torch.set_num_threads(1)  # rollout and the other workers share the node's cores with us
    try:
        device = resolve_device()
    except ValueError as exc:
        raise CannotAttach(str(exc)) from None
    try:  # a .gguf file is converted once per node, a hub id fetched: off the event loop
        model = await asyncio.to_thread(
            resolve_model_path, rt.config.model.path, rt.config.model.revision
        )
    except ModelNotFound as exc:
        raise CannotAttach(str(exc)) from None
    group = await join(rt, rt.rank, device)  # fsdp: every rank's process group; torch: alone
    trainer = Trainer(rt, group.rank, group, device)
    trainer.phases = await Phases.of(rt, Phase.TRAIN)
    if trainer.phases is not None and rt.config.trainer.offload_optimizer:
        if not isinstance(trainer.engine, ReleasableTrainEngine):  # the config refuses it first
            raise CannotAttach(f"trainer.engine {trainer.engine.name} cannot offload its optimizer")
        trainer.phases.engine = OptimizerTurns(trainer.engine)
    trainer.lender = await Lender.of(rt, model)
    helpers = (
        {"process group watch": lambda: watch(group, trainer.done)}
        if group.store is not None
        else {}
    )
    if trainer.lender is not None:
        helpers |= trainer.lender.helpers()
    return Stage(channel=None, handler=None, main=trainer.run, close=trainer.close, helpers=helpers)


if __name__ == "__main__":
    run_stage("trainer", build, __doc__.splitlines()[0], with_rank=True)
