"""Trainer ranks: the train engine a run's config sets up (built by `engines.build`), and the
process group its fsdp ranks share.

Rendezvous (`trainer.dist_init`):

    kv    rank 0   listens on (dist_host, or its address on the route to NATS; a free port), runs
                   a TCPStore server on that socket, and puts KV `trainer.rendezvous` =
                   {host, port, world_size, generation} (generation: a fresh id per rank-0 process)
          rank k   reads the key, connects, claims `rank/<k>` in the generation's store:
                   the first claim joins; a second means this generation already had a rank k,
                   which died, so the group is broken: its rank 0 will fail (below) and come back
                   with a new generation, which rank k waits for (up to dist_timeout)
          all      init_process_group over the generation's prefix of the store, with
                   dist_timeout on every collective
    env   torchrun: MASTER_ADDR/MASTER_PORT, and RANK/WORLD_SIZE instead of --rank

A rank that dies (kv): the others fail within WATCH_SECONDS, not at their next collective, by the
group watch (a helper of the trainer stage): a rank claimed twice (its replacement is waiting)
or a store that stopped answering (rank 0 is gone) fails the stage, exit 1. The fleet restarts
each rank, they meet in rank 0's new generation, and every rank resumes from the last committed
checkpoint and reads its batches from its own last sequence + 1. Without the watch, a rank in a
collective fails at once anyway (gloo: the dead peer's socket closes; NCCL: dist_timeout).
Under torchrun (env) its elastic agent restarts the whole group instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from nats.js.errors import KeyNotFoundError

from bus.runtime import CannotAttach, Runtime
from bus.topology import RENDEZVOUS_KEY
from consumers.weights.sender import ShardNote
from engines.algorithms.schedule import lr_factor
from engines.build import build_train_engine
from engines.device import torch_dtype
from engines.fsdp_train import init_group
from engines.model_source import ModelNotFound, resolve_model_path
from engines.protocols import EngineUnavailable, TrainEngine
from engines.torch_train import CriticConfig, LossConfig
from schemas.config import RunConfig
from schemas.kv_records import Rendezvous

log = logging.getLogger("jetrl.trainer")

WATCH_SECONDS = 2.0
"""How often a rank checks that its group is whole."""
PROBE_SECONDS = 5.0
"""How long a joining rank tries to reach an announced rank 0 before taking it for gone."""


class RendezvousFailed(CannotAttach):
    """This rank cannot join its group, or its group broke: said in one line
    (the process exits 1)."""


@dataclass
class RankGroup:
    """This process's place in the trainer ranks' process group."""

    rank: int
    world_size: int
    store: dist.Store | None = None
    """kv: the generation's store (every claim is in it); None under torchrun."""
    listener: socket.socket | None = None
    """Rank 0's listening socket, kept open for the store server's life."""


def configured_engine(cfg: RunConfig, loss: LossConfig, device: torch.device) -> TrainEngine:
    """The engine `trainer.engine` names (fsdp: after `join`), in `model.dtype` on `device`,
    with the run's optimizer, schedule and loss settings."""
    algo = cfg.algorithm
    schedule = partial(
        lr_factor,
        warmup=algo.lr_warmup_steps,
        total=cfg.trainer.steps,
        schedule=algo.lr_schedule,
        min_ratio=algo.lr_min_ratio,
    )
    args: dict[str, Any] = {
        "lr": algo.lr,
        "weight_decay": algo.weight_decay,
        "seed": cfg.trainer.seed,
        "loss": loss,
        "device": device,
        "dtype": torch_dtype(cfg.model.dtype),
        "logprob_chunk_tokens": cfg.trainer.logprob_chunk_tokens,
        "activation_checkpointing": cfg.trainer.activation_checkpointing,
        "lr_schedule": schedule,
        "ppo_epochs": algo.ppo_epochs,
        "ppo_mini_batches": algo.ppo_mini_batches,
    }
    if cfg.reference.enabled:  # the reference stage scores it: no frozen copy here
        args["own_reference"] = False
    try:
        model_dir = resolve_model_path(
            cfg.model.path, cfg.model.revision
        )  # a hub id: fetched or cached
    except ModelNotFound as exc:
        raise CannotAttach(str(exc)) from None
    try:
        return build_train_engine(cfg.trainer.engine, model_dir, critic=critic_config(cfg), **args)
    except EngineUnavailable as exc:  # megatron without megatron-core: one line, what to install
        raise CannotAttach(str(exc)) from None


def critic_config(cfg: RunConfig) -> CriticConfig | None:
    """The value model's settings for `algorithm.advantage: gae` (the torch and fsdp engines'),
    else None."""
    algo = cfg.algorithm
    if algo.advantage != "gae":
        return None
    return CriticConfig(
        lr=algo.critic_lr or algo.lr,
        gamma=algo.gamma,
        lam=algo.gae_lambda,
        value_clip=algo.value_clip,
        weight_decay=algo.weight_decay,
    )


async def join(rt: Runtime, rank: int, device: torch.device) -> RankGroup:
    """Meet the run's other trainer ranks in a process group (fsdp; megatron above one rank per
    copy), or stand alone (torch; megatron at tensor and pipeline parallel 1)."""
    tcfg = rt.config.trainer
    world = tcfg.ranks
    if world == 1 and not tcfg.engine.grouped:
        return RankGroup(rank, 1)
    if tcfg.dist_init == "env":
        try:
            rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError):
            raise RendezvousFailed(
                "trainer.dist_init env: RANK and WORLD_SIZE must be set (start it with torchrun)"
            ) from None
        if size != world:
            raise RendezvousFailed(
                f"torchrun started {size} ranks, the trainer has {world} "
                "(trainer.dp_size x tensor x pipeline parallel)"
            )
        await asyncio.to_thread(init_group, None, rank, world, device, tcfg.dist_timeout)
        return RankGroup(rank, world)
    if not 0 <= rank < world:
        raise RendezvousFailed(
            f"--rank {rank}: the trainer has {world} ranks (dp_size x tensor x pipeline parallel), "
            f"so 0..{world - 1}"
        )
    group = await (_host(rt, world) if rank == 0 else _claim(rt, rank, world))
    assert group.store is not None
    await asyncio.to_thread(init_group, group.store, rank, world, device, tcfg.dist_timeout)
    log.info("rank %d of %d joined the process group", rank, world)
    return group


async def _host(rt: Runtime, world: int) -> RankGroup:
    """Rank 0: a new generation, its store on a socket of ours (one address, never all of them)."""
    tcfg = rt.config.trainer
    host = tcfg.dist_host or route_address(rt)
    listener = socket.create_server((host, 0))
    port = listener.getsockname()[1]
    server = dist.TCPStore(
        host,
        port,
        world,
        True,
        timeout=timedelta(seconds=tcfg.dist_timeout),
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
    )
    generation = uuid.uuid4().hex[:12]
    announce = Rendezvous(host=host, port=port, world_size=world, generation=generation)
    await rt.kv.put(RENDEZVOUS_KEY, announce.encode())
    log.info("rank 0 hosts generation %s at %s:%d", generation, host, port)
    return RankGroup(0, world, dist.PrefixStore(generation, server), listener)


async def _claim(rt: Runtime, rank: int, world: int) -> RankGroup:
    """Rank k: the newest announced generation that has no rank k yet."""
    timeout = rt.config.trainer.dist_timeout
    deadline = asyncio.get_running_loop().time() + timeout
    refused: set[str] = set()
    while asyncio.get_running_loop().time() < deadline:
        try:
            entry = await rt.kv.get(RENDEZVOUS_KEY)
            announce: Rendezvous | None = Rendezvous.decode(entry.value)
        except KeyNotFoundError:
            announce = None
        if announce is None or announce.generation in refused:
            await asyncio.sleep(0.5)
            continue
        generation, address = announce.generation, (announce.host, announce.port)
        if announce.world_size != world:
            raise RendezvousFailed(
                f"rank 0 announced {announce.world_size} ranks, this rank's config has {world}"
            )
        store = await asyncio.to_thread(_connect, address, world, timeout)
        if store is None:
            log.info(
                "generation %s: rank 0 at %s:%d is gone; waiting for the next", generation, *address
            )
        else:
            store = dist.PrefixStore(generation, store)
            if await asyncio.to_thread(store.add, f"rank/{rank}", 1) == 1:
                return RankGroup(rank, world, store)
            log.info(
                "generation %s already had a rank %d: waiting for rank 0's next generation",
                generation,
                rank,
            )
        refused.add(generation)
    raise RendezvousFailed(
        f"rank {rank}: no trainer rank 0 to join after {timeout:.0f}s (trainer.dist_timeout)"
    )


def _connect(address: tuple[str, int], world: int, timeout: float) -> dist.Store | None:
    """A client of the store at `address`, or None if nothing answers there within PROBE_SECONDS
    (the TCPStore client itself would retry for its whole timeout)."""
    try:
        socket.create_connection(address, timeout=PROBE_SECONDS).close()
    except OSError:
        return None
    return dist.TCPStore(address[0], address[1], world, False, timeout=timedelta(seconds=timeout))


def route_address(rt: Runtime) -> str:
    """This host's address on the route to the NATS server it is connected to (no packet is sent:
    connecting a UDP socket only picks the route). Peers that reach NATS can reach it too."""
    url = rt.nc.connected_url
    host, port = (
        (url.hostname or "127.0.0.1", url.port or 4222) if url is not None else ("127.0.0.1", 4222)
    )
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return str(probe.getsockname()[0])


async def watch(group: RankGroup, done: Callable[[], bool]) -> None:
    """Fail when the group is broken (a stage helper: its error ends the process, exit 1).

    Once `done()` (the run's last step is trained) it only waits: rank 0 exits first, and its
    store with it, which is then no failure."""
    if group.store is None or group.world_size == 1:
        await asyncio.Event().wait()
        return
    store = group.store
    while not done():
        try:
            claims = [
                await asyncio.to_thread(store.add, f"rank/{k}", 0)
                for k in range(1, group.world_size)
            ]
        except (RuntimeError, dist.DistError) as exc:
            if done():
                break
            raise RendezvousFailed(
                f"rank 0's store stopped answering ({exc}): the group is gone"
            ) from None
        twice = [k + 1 for k, n in enumerate(claims) if n > 1]
        if twice:
            raise RendezvousFailed(
                f"rank {twice[0]} restarted: the process group is broken, all ranks restart"
            )
        await asyncio.sleep(WATCH_SECONDS)
    await asyncio.Event().wait()


async def exchange(note: ShardNote) -> list[ShardNote]:
    """Every trainer rank's note of the version being published, in rank order: one
    `all_gather_object` over the default group (gloo on the CPU: each rank's shard location
    and manifest entries, pickled, about 200 bytes per tensor),
    in a thread so the event loop keeps serving."""
    notes: list[ShardNote | None] = [None] * dist.get_world_size()
    await asyncio.to_thread(dist.all_gather_object, notes, note)
    return [n for n in notes if n is not None]


def leave(group: RankGroup) -> None:
    """Destroy the process group and close rank 0's socket."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if group.listener is not None:
        group.listener.close()
