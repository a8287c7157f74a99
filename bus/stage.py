"""One shape for every worker process: a builder says what the stage is, one runner runs it.

    build(rt) -> Stage      the channel and handler it serves, its WorkerOptions, its helpers
    run_stage(role, build)  attach -> build -> serve -> close; `main` of a worker is this call
        SIGTERM/SIGINT during attach or build -> that step is cancelled, exit 0

    serve(rt, stage, stop): one asyncio.TaskGroup holds the stage's loop and every helper
        (the membership heartbeat too); the loop is the worker loop over the channel's work
        queue, or the stage's own `main` (the trainer's steps, read by position)
        SIGTERM/SIGINT -> stop: the loop stops fetching and drains its handlers, then the
            helpers are cancelled (again until they end: `bus.tasks`), then the stage
            closes and the process exits 0
        `main` returns (the run's last step is trained) -> helpers cancelled, exit 0
        a helper raises, or returns while the stage runs -> the group cancels everything:
            one log line names the helper and its error, the process exits 1, and the fleet
            restarts it

Helpers are loops the handlers depend on (the rollout's batcher resolves the futures its
handlers await; its weights watcher reopens the gate they wait at). Run as bare tasks, one
that died took nothing down: the process stayed up, held its messages and heartbeat them,
and did no work again. Under the group its death is the process's.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from argparse import Namespace
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from bus import loss
from bus.runtime import CannotAttach, Runtime, attach, worker_args
from bus.tasks import cancel_until_done, recancelled
from bus.topology import Channel
from bus.worker import Handler, OnDead, Worker, WorkerOptions, stop_on_signals
from schemas.events import Event

log = logging.getLogger("jetrl.stage")

E = TypeVar("E", bound=Event)
T = TypeVar("T")

MEMBERSHIP = "membership heartbeat"
"""The helper every stage runs: its entry in the run's members bucket."""

LOSS_GUARD = "loss guard"
"""The helper of every stage that serves a work queue: reports work its stream deleted unacked
(`bus.loss`)."""

Helper = Callable[[], Coroutine[Any, Any, None]]
MainLoop = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


@dataclass
class Stage(Generic[E]):
    """What one worker process runs: the channel it serves, and the loops beside it."""

    channel: Channel[E] | None
    """The work queue it serves (`bus.topology.WORK_QUEUES`); None for a stage with a `main`."""
    handler: Handler[E] | None
    options: WorkerOptions = field(default_factory=WorkerOptions)
    helpers: dict[str, Helper] = field(default_factory=dict)
    """Loops that run as long as the stage, by the name a failure is reported under."""
    close: Callable[[], Awaitable[None]] | None = None
    """Releases what the builder acquired (a process pool), after the worker loop has drained."""
    on_dead: OnDead[E] | None = None
    """Called with an event of `channel` before it is dead-lettered (`bus.worker.OnDead`)."""
    main: MainLoop | None = None
    """The stage's own loop instead of a work queue, until its work is done or the stop event
    is set; its return ends the stage with success, its error fails it."""


Builder = Callable[[Runtime], Coroutine[Any, Any, Stage[Any]]]


class StageFailed(Exception):
    """A helper or the worker loop of a stage failed; the process exits for the fleet to restart
    it."""


async def serve(rt: Runtime, stage: Stage[Any], stop: asyncio.Event) -> None:
    """Run `stage` until `stop` is set, then drain; StageFailed if a helper or the loop fails."""
    helpers = dict(stage.helpers)
    if not rt.member.background:
        helpers[MEMBERSHIP] = rt.member.beat
    if (channel := stage.channel) is not None:
        every = rt.config.streams.guard_seconds
        helpers[LOSS_GUARD] = lambda: loss.watch(rt.js, rt.kv, rt.topology, channel, every)
    try:
        async with asyncio.TaskGroup() as group:
            running = [
                group.create_task(recancelled(_watched(name, helper), name), name=name)
                for name, helper in helpers.items()
            ]
            if stage.main is not None:
                await recancelled(stage.main(stop), "main")
            elif stage.channel is not None and stage.handler is not None:
                worker = Worker(
                    rt.js,
                    rt.topology,
                    stage.channel,
                    stage.handler,
                    rt.publisher,
                    stage.options,
                    stage.on_dead,
                )
                await recancelled(worker.run(stop), "worker")
            else:
                await stop.wait()
            await cancel_until_done(running)  # a helper mid-request can swallow one cancel
    except ExceptionGroup as failed:
        raise StageFailed("; ".join(_describe(exc) for exc in _leaves(failed))) from failed


async def _watched(name: str, helper: Helper) -> None:
    """Run a helper; its error, or its return while the stage still runs, fails the stage."""
    try:
        await helper()
    except Exception as exc:
        log.error("helper %s failed: %s: %s", name, type(exc).__name__, exc, exc_info=exc)
        raise _HelperFailed(f"helper {name} failed: {type(exc).__name__}: {exc}") from exc
    log.error("helper %s stopped while the stage runs", name)
    raise _HelperFailed(f"helper {name} stopped while the stage runs")


class _HelperFailed(Exception):
    """Carries the helper's name with its error."""


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return found


def _describe(exc: BaseException) -> str:
    return (
        str(exc)
        if isinstance(exc, _HelperFailed)
        else f"stage loop failed: {type(exc).__name__}: {exc}"
    )


async def _run(role: str, args: Namespace, build: Builder) -> None:
    # Signals first: SIGTERM while the worker joins the run (which waits for the run's config)
    # or builds its stage ends it with nothing to drain, exit 0, not killed mid-join.
    stop = asyncio.Event()
    stop_on_signals(stop)
    rank = getattr(args, "rank", 0)
    rt = await _unless_stopped(
        attach(role, args.run, args.nats, args.replicas, beat_in_background=False, rank=rank), stop
    )
    if rt is None:
        log.info("stopped before it joined the run")
        return
    try:
        stage = await _unless_stopped(build(rt), stop)
        if stage is None:
            log.info("stopped while building its stage")
            return
        try:
            await serve(rt, stage, stop)
        finally:
            if stage.close is not None:
                await stage.close()
    finally:
        started = time.monotonic()
        await rt.close()
        log.info("left the run in %.1f s", time.monotonic() - started)


async def _unless_stopped(step: Coroutine[Any, Any, T], stop: asyncio.Event) -> T | None:
    """`step`'s result, or None when `stop` is set before it ends (it is cancelled then)."""
    task = asyncio.create_task(step)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not task.done():
        await cancel_until_done([task])
    return None if task.cancelled() else task.result()


def run_stage(
    role: str, build: Builder, description: str, *one_line: type[Exception], with_rank: bool = False
) -> None:
    """`python -m consumers.<role> --run R [--nats URL] [--replicas N] [--rank K]`:
    run `build`'s stage.

    CannotAttach, StageFailed and the `one_line` types (a builder's refusal to start) end the
    process with one line on stderr and exit status 1.
    """
    args = worker_args(role, description, with_rank=with_rank)
    refusals: tuple[type[Exception], ...] = (CannotAttach, StageFailed, *one_line)
    try:
        asyncio.run(_run(role, args, build))
    except refusals as exc:
        sys.exit(f"consumers.{role}: {exc}")
