"""`python -m ops.bench.scale_workers --run R --nats URL --workers K`: K simulated rollout
workers in one process, for `ops.bench.scale`.

    attach once (one connection, the run's config) -> per worker i:
        its own membership entry (`Membership.join(..., worker=<process id>-w<i>)`),
        its own simulated engine, `consumers.rollout.Rollout` and `rollout_stage`:
        its own pull requests on the prompts queue, in_progress heartbeats, batcher,
        weights receiver (a `Broadcast` reader of the weights stream) and loss guard
    -> every worker's `bus.stage.serve` under one TaskGroup (one failing ends the process,
       and the fleet restarts it) -> SIGTERM: each drains, leaves the members, then the
       connection closes

What differs from K rollout processes: the K workers share one NATS connection and its
publisher, and one Python event loop. The server sees the same subscriptions, pull
requests, heartbeats and KV writes as from K processes, but one TCP connection; the client
side's CPU is that of K workers on one core, which is what `ops.bench.scale` reports as
the rollout processes' CPU.

The simulated engine generates in a thread: the loop's default executor (min(32, cores + 4)
threads) would let only a handful of K workers generate at once, so it is sized for K.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bus.connection import DEFAULT_URL, worker_id
from bus.membership import Membership
from bus.runtime import Runtime, attach
from bus.stage import serve
from bus.tasks import cancel_until_done
from bus.worker import stop_on_signals
from consumers.rollout import Rollout, rollout_stage
from engines.build import build_rollout_engines
from engines.model_source import resolve_model_path

log = logging.getLogger("jetrl.scale_workers")


async def worker(
    rt: Runtime, index: int, model: Path, tokenizer: PreTrainedTokenizerBase
) -> tuple[Runtime, Rollout]:
    """Worker `index` of this process: its own member entry and Rollout, on `rt`'s connection."""
    cfg = rt.config.rollout
    name = f"{worker_id('rollout')}:w{index}"
    member = await Membership.join(rt.js, rt.topology, "rollout", background=False, worker=name)
    engines = build_rollout_engines(
        cfg.engine,
        model,
        cfg.engine_copies,
        seed=rt.config.data.seed + 1000 * index,
        dtype=rt.config.model.dtype,
        continuous=cfg.continuous,
    )
    own = dataclasses.replace(rt, member=member, worker=name)
    rollout = Rollout(own, engines, tokenizer)
    member.report(engine=cfg.engine.type, weight_version=rollout.engine.version)
    return own, rollout


async def main(run: str, url: str, replicas: int, workers: int) -> None:
    stop = asyncio.Event()
    stop_on_signals(stop)
    loop = asyncio.get_running_loop()
    # One generating thread per worker and engine copy, plus the receivers' loads.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=2 * workers + 8))
    rt = await attach("rollout", run, url, replicas, beat_in_background=False)
    # The process itself is no worker: only its K workers are members.
    await rt.member.leave()
    model = await asyncio.to_thread(
        resolve_model_path, rt.config.model.path, rt.config.model.revision
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    built = [await worker(rt, i, model, tokenizer) for i in range(workers)]
    log.info("%d simulated rollout workers joined run %s", workers, run)
    try:
        async with asyncio.TaskGroup() as group:
            for own, rollout in built:
                group.create_task(serve(own, rollout_stage(rollout), stop))
    finally:
        leaving = [asyncio.create_task(own.member.leave()) for own, _ in built]
        try:
            await asyncio.wait_for(asyncio.gather(*leaving, return_exceptions=True), 10)
        except TimeoutError:
            await cancel_until_done(leaving)
        await rt.close()


def cli() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.scale_workers", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run", required=True)
    parser.add_argument("--nats", default=os.environ.get("JETRL_NATS_URL", DEFAULT_URL))
    parser.add_argument("--replicas", type=int, choices=[1, 3, 5], default=1)
    parser.add_argument("--workers", type=int, required=True, help="simulated workers to run")
    args = parser.parse_args()
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(levelname)s %(message)s")
    # The workers' engines only sleep; torch threads would take cores from the server.
    torch.set_num_threads(1)
    asyncio.run(main(args.run, args.nats, args.replicas, args.workers))


if __name__ == "__main__":
    cli()
