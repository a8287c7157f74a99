"""`python -m ops.audit --run R [--nats URL]`: account for every prompt of a run, from the streams.

Reads the prompt stream, the batch streams, the KV drop records and the trainer's per-step
metrics records (messages that do not decode are poison the workers dead-lettered, and are
left out), and reports: issued prompts; prompts whose group was trained (in a step the trainer
recorded, or in a batch still stored: the trainer deletes batches its checkpoints no longer need),
dropped (with reasons; a record without one is listed), or neither (in flight at shutdown);
samples stored in a batch that no metrics record says the trainer trained (a micro-batch it
refused, dead-lettered with the reason); sample ids trained more than once; tokens trained
at a staleness beyond the bound; work streams' messages deleted before they were acked
(`lost`, `bus.loss`, the reference stage's queue among them when the run has one); with the
reference stage, samples batched without reference log-probs (`without_reference`). Last
line: one JSON object. A read the server refuses while a node's streams elect new leaders is
retried, the whole audit over (it only reads).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections import Counter
from typing import Any, TypeVar

import numpy as np
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus import loss
from bus.connection import DEFAULT_URL, connect
from bus.election import TRANSIENT, ride_out
from bus.membership import stored_keys
from bus.readers import Poison, Replay
from bus.topology import (
    BATCHES,
    PROMPTS,
    Channel,
    Topology,
    dropped_prompt,
    metrics_of,
    run_id_arg,
)
from ops.streams import as_stored, stored_config
from schemas import Event
from schemas.kv_records import DropKind, DropRecord, StepMetrics
from schemas.staleness import StalenessPolicy

E = TypeVar("E", bound=Event)
AUDIT_SECONDS = 120.0
"""How long an audit refused by elections is started over:
reading a long run takes a while itself."""


def drop_kind(record: DropRecord) -> str:
    """A drop's kind (`DropKind`); for a record stored before kinds, its reason's first words."""
    if (kind := record.typed) is not DropKind.UNKNOWN:
        return kind.value
    return record.reason.split(":")[0].split(" (")[0]


async def replay_events(js: JetStreamContext, topology: Topology, channel: Channel[E]) -> list[E]:
    """Every event stored, up to the last sequence stored now (`bus.readers.Replay`); poison
    among them is logged and left out (an operator's tool has no dead letters of its own)."""
    replay: Replay[E] = Replay(js, topology, channel, Poison("audit"))
    async with replay:
        return [stored.event async for stored in replay]


async def audit(
    js: JetStreamContext, topology: Topology, staleness: StalenessPolicy
) -> dict[str, Any]:
    prompts = [p.id for p in await replay_events(js, topology, PROMPTS)]
    batches = await replay_events(js, topology, BATCHES)
    kv = await js.key_value(topology.kv_bucket)
    # Not `kv.keys()`: its listing can end before the first key arrives, and an audit that
    # saw no drop records counted every dropped group as in flight (seen in the e2e test).
    keys = await stored_keys(js, topology.kv_bucket)
    drop_keys = {pid: k for k in keys if (pid := dropped_prompt(k)) is not None}
    # An empty record reads back as None: kept, as a drop without a reason.
    records = {pid: DropRecord.decode((await kv.get(k)).value) for pid, k in drop_keys.items()}
    dropped = {pid: record.text for pid, record in records.items()}
    # What the trainer says it trained: each step's record lists the ids of the micro-batches
    # it took (a refused one is in the batch stream but not here). The records cover the whole
    # run; the batch stream only what the trainer's checkpoints still need (it trims the rest),
    # so the accounts are the records' and the kept batches' together.
    step_records = [
        StepMetrics.decode((await kv.get(k)).value).flat()
        for k in keys
        if metrics_of(k) is not None
    ]
    trainer_ids = {sid for record in step_records for sid in record.get("sample_ids", [])}
    # Per step, each sample once: a split agent episode is a row per segment, all with its id
    # (`consumers.packing`), so a step holds its id more than once; a repeat is a second step.
    in_step: dict[int, set[str]] = {}
    for b in batches:
        in_step.setdefault(b.step, set()).update(b.sample_ids)
    batched = Counter(sid for ids in in_step.values() for sid in ids)
    recorded = Counter(sid for record in step_records for sid in set(record.get("sample_ids", [])))
    trained = batched | recorded  # per sample, the larger count: a repeat in either shows
    trained_prompts = {sid.rsplit("/", 1)[0] for sid in trained}
    # Staleness of the trained tokens from the records' histograms (step - version per loss
    # token); of kept batches no record covers yet (batched, not trained yet) from the batch.
    unrecorded = [b for b in batches if not set(b.sample_ids) <= trainer_ids]
    violations = sum(staleness.over_bound(r.get("staleness_hist", [])) for r in step_records)
    for b in unrecorded:
        versions = b.versions.numpy()[b.loss_mask.numpy() == 1]
        violations += int((versions < staleness.oldest_version(b.step)).sum())
    seen_staleness = [int(r.get("staleness_max", 0)) for r in step_records] + [
        int(b.step - b.versions.numpy()[b.loss_mask.numpy() == 1].min())
        for b in unrecorded
        if b.loss_mask.numpy().any()
    ]
    rewards = {
        int(r["step"]): float(r["reward_mean"])
        for r in step_records
        if "step" in r and r.get("samples")
    }
    for b in sorted(unrecorded, key=lambda b: b.step):
        rewards.setdefault(b.step, float(np.mean(b.rewards.numpy())))
    issued = set(prompts)
    return {
        "issued": len(issued),
        "trained": len(trained_prompts & issued),
        "dropped": len(set(dropped) & issued),
        "dropped_without_reason": sorted(
            pid for pid, reason in dropped.items() if not reason.strip()
        ),
        "unknown_dropped": len(set(dropped) - issued),
        "in_flight": len(issued - trained_prompts - set(dropped)),
        "in_flight_ids": sorted(issued - trained_prompts - set(dropped)),
        "unknown_trained": len(trained_prompts - issued),
        "samples_trained": sum(trained.values()),
        "batched_not_trained": len(set(batched) - trainer_ids),
        "duplicates": sum(c - 1 for c in trained.values() if c > 1),
        "trained_and_dropped": len(trained_prompts & set(dropped)),
        "staleness_violations": violations,
        "steps": len(
            {int(r["step"]) for r in step_records if "step" in r} | {b.step for b in batches}
        ),
        "drop_reasons": dict(Counter(map(drop_kind, records.values()))),
        "max_staleness_seen": max(seen_staleness, default=0),
        "reward_by_step": [rewards[step] for step in sorted(rewards)],
        # Per work stream, messages deleted before their work queue acked them (`bus.loss`):
        # 0 in a run whose limits hold; None where the server could not say.
        "lost": await loss.all_lost(js, kv, topology),
        # With the reference stage, every sample of the kept batches must have passed it (its
        # batch carries reference log-probs); None for a run without the stage. Samples, not
        # rows: a split episode's segments are rows of one id.
        "without_reference": len(
            {sid for b in batches if b.ref_logprobs is None for sid in b.sample_ids}
        )
        if topology.reference
        else None,
    }


async def main(args: argparse.Namespace) -> None:
    nc = await connect(args.nats, "ops-audit")
    js, topology = nc.jetstream(), Topology(run=args.run)
    try:
        topology = await ride_out(
            lambda: as_stored(js, topology), f"reading run {args.run}'s config"
        )
        config, _ = await ride_out(lambda: stored_config(js, args.run), "reading its config")
        # The bound the operator names (the flag's default, not the stored run's: as before).
        staleness = dataclasses.replace(config.staleness, bound=args.bound)
        result = await ride_out(
            lambda: audit(js, topology, staleness), f"auditing run {args.run}", AUDIT_SECONDS
        )
    finally:
        await nc.close()
    print(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m ops.audit", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run", required=True, type=run_id_arg)
    parser.add_argument("--nats", default=os.environ.get("JETRL_NATS_URL", DEFAULT_URL))
    parser.add_argument("--max-staleness", dest="bound", type=int, default=1)
    arguments = parser.parse_args()
    try:
        asyncio.run(main(arguments))
    except TRANSIENT as exc:
        sys.exit(f"ops.audit: no answer from NATS at {arguments.nats}: {type(exc).__name__} {exc}")
    except NotFoundError:
        sys.exit(
            f"ops.audit: run {arguments.run} has no streams on {arguments.nats}; "
            "is the run id right?"
        )
