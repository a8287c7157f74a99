"""`python -m ops.status --run R [--nats URL] [--watch]`: where a run stands,
from its streams, consumers and KV.

`--out DIR` instead of `--run`/`--nats`: the local job's run directory, whose `server.json`
names the run, its server's URL and the admin identity to connect with (`bus.run_dir`).

    stages   messages stored per stream, and arriving per second
    queues   per work queue: pending, in flight (ack pending), redelivered, done per second
             (taken and no longer in flight: acked or terminated)
    dead     dead letters by the worker that wrote them
    drops    dropped groups by kind, and the reward function's failures by reason
    lost     work a stream deleted before its work queue acked it (`bus.loss`): should be none
    trainer  the step of the live trainer(s), the latest weight version
    staleness  step - version over the loss tokens of the last batches in the stream
    stalled  when no step completed for the run's `trainer.stall_after`: who holds the work and why
    workers  the live members: role, node, pid, engine, weights, uptime, last heartbeat

Rates are the difference between two samples 1 s apart, or, with --watch, between two
redraws (every 2 s). A figure the server cannot give now (a stream electing a leader after
a node died) is shown as `?` and read again at the next redraw. Nothing is written anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus import loss
from bus.connection import DEFAULT_URL, connect
from bus.election import or_unknown
from bus.lag import QueueLag, queue_lag
from bus.membership import Member, live_members
from bus.readers import LastStored, Poison
from bus.run_dir import RunDirError, read_server
from bus.topology import (
    BATCHES,
    CHANNELS,
    DEAD,
    WEIGHTS,
    Topology,
    run_id_arg,
)
from ops.streams import as_stored
from producers.drops import DropTally, failures_line
from producers.stall import stalled_line
from producers.stall_view import read_drops
from schemas import BatchEvent, WeightVersionEvent

T = TypeVar("T")
CLEAR = "\033[H\033[J"
WATCH_SECONDS = 2.0
CONNECT_SECONDS = 10.0
CLOSE_SECONDS = 2.0
"""Seconds an interrupted page loop gets to close its connection before the process exits anyway."""


@dataclass(frozen=True)
class StageState:
    """One stage's stream."""

    messages: int
    """Messages stored now."""
    bytes: int
    """Bytes stored now."""
    last_seq: int
    """Messages ever stored: its difference between samples is the arrival rate."""


@dataclass(frozen=True)
class Sample:
    """The counters of a run at one moment; two of them give the rates."""

    time: float
    stages: dict[str, StageState | None]
    """None: unknown now (as for each figure below)."""
    queues: dict[str, QueueLag | None]
    """Per work queue (by durable)."""
    dead: dict[str, int] | None
    """Dead letters by the worker (stage) that wrote them."""


@dataclass(frozen=True)
class Details:
    """What is shown as it is now, no rate: membership, weights, recent batches."""

    members: list[Member] | None
    """None: unknown now."""
    weights: int | None
    """Latest published weight version, None before the first (or when in `unknown`)."""
    batches: list[BatchEvent] | None
    """The last few readable batch events, oldest first; None: unknown now."""
    unknown: frozenset[str] = frozenset()
    """The figures above the server could not give now ("weights" among them)."""
    stalled: str | None = None
    """Who holds the work, when no step completed for the run's `trainer.stall_after`."""
    lost: dict[str, int | None] | None = None
    """Per work stream, messages deleted before their work queue acked them (`bus.loss`);
    None: unknown."""
    drops: DropTally | None = None
    """Every drop record of the run, counted (`producers.drops`); None: unknown."""


async def sample(js: JetStreamContext, topology: Topology) -> Sample:
    stages: dict[str, StageState | None] = {}
    for channel in CHANNELS:
        info = await or_unknown(
            lambda: js.stream_info(topology.stream(channel)),  # noqa: B023 - awaited at once
            f"stream {channel.name}",
        )
        stages[channel.name] = (
            None
            if info is None
            else StageState(info.state.messages, info.state.bytes, info.state.last_seq)
        )
    queues = await queue_lag(js, topology)
    dead_info = await or_unknown(
        lambda: js.stream_info(topology.stream(DEAD), subjects_filter=topology.subject(DEAD, ">")),
        "dead letters",
    )
    dead = (
        None
        if dead_info is None
        else {
            subject.rsplit(".", 1)[1]: count
            for subject, count in (dead_info.state.subjects or {}).items()
        }
    )
    return Sample(time.monotonic(), stages, queues, dead)


async def details(js: JetStreamContext, topology: Topology, batches: int) -> Details:
    unknown = set()
    weights: int | None = None
    reader: LastStored[WeightVersionEvent] = LastStored(js, topology, WEIGHTS, Poison("status"))
    # In a 1-tuple: or_unknown's None (the bus cannot say now) is not the reader's (nothing
    # stored, or poison, which the reader logs).
    found = await or_unknown(lambda: _known(reader.last()), "latest weights")
    if found is None:
        unknown.add("weights")
    elif found[0] is not None:
        weights = found[0].event.version
    return Details(
        await or_unknown(lambda: live_members(js, topology), "live members"),
        weights,
        await or_unknown(lambda: recent_batches(js, topology, batches), "recent batches"),
        frozenset(unknown),
        await or_unknown(lambda: stalled_line(js, topology), "the stall diagnosis"),
        await or_unknown(lambda: _lost(js, topology), "the loss guard"),
        await or_unknown(lambda: read_drops(js, topology, time.time()), "the drop records"),
    )


async def _known(call: Awaitable[T]) -> tuple[T]:
    return (await call,)


async def _lost(js: JetStreamContext, topology: Topology) -> dict[str, int | None]:
    return await loss.all_lost(js, await js.key_value(topology.kv_bucket), topology)


def lost_line(lost: dict[str, int | None] | None) -> str:
    """`lost work: none`, or loudly which streams deleted how many messages nobody acked."""
    if lost is None:
        return "lost work: ?"
    found = {name: n for name, n in lost.items() if n}
    if not found:
        unknown = ", ".join(name for name, n in lost.items() if n is None)
        return f"lost work: none (unknown: {unknown})" if unknown else "lost work: none"
    counts = ", ".join(f"{name} {n}" for name, n in found.items())
    return (
        f"LOST WORK: {counts} message(s) deleted before their work queue acked them "
        "(a stream limit too low: streams.max_bytes / streams.max_age_s)"
    )


async def recent_batches(
    js: JetStreamContext, topology: Topology, batches: int
) -> list[BatchEvent]:
    """The last `batches` readable batch events of the run, oldest first (deleted ones and
    garbage the trainer dead-letters are stepped over)."""
    reader: LastStored[BatchEvent] = LastStored(js, topology, BATCHES, Poison("status"))
    _, last = await reader.bounds()
    recent = [stored.event async for stored in reader.back(start=last, limit=batches)]
    return recent[::-1]


def _size(n: int) -> str:
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return (
        f"{hours}h{minutes:02d}m"
        if hours
        else f"{minutes}m{secs:02d}s"
        if minutes
        else f"{seconds:.1f}s"
    )


def staleness_line(batches: list[BatchEvent]) -> str:
    """The distribution of step - version over the loss tokens of `batches`."""
    counts: Counter[int] = Counter()
    for b in batches:
        versions = b.versions.numpy()[b.loss_mask.numpy() == 1]
        counts.update((b.step - versions).tolist())
    total = sum(counts.values())
    if not total:
        return "staleness: no batches yet"
    shares = "  ".join(f"{s}: {100 * n / total:.1f}%" for s, n in sorted(counts.items()))
    first, last = min(b.step for b in batches), max(b.step for b in batches)
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    return f"staleness (step - version) over {steps}, {total} loss tokens: {shares}"


def render(topology: Topology, before: Sample, now: Sample, info: Details) -> str:
    """The status page: `now` as it is, rates from `before` to `now`."""
    seconds = max(now.time - before.time, 1e-9)
    lines = [f"run {topology.run}  {time.strftime('%Y-%m-%d %H:%M:%S')}", ""]
    lines.append(f"{'stage':<13} {'messages':>9} {'bytes':>10} {'in/s':>8}")
    for stage, s in now.stages.items():
        if s is None:
            lines.append(f"{stage:<13} {'?':>9} {'?':>10} {'?':>8}")
            continue
        was = before.stages.get(stage)
        rate = "?" if was is None else f"{(s.last_seq - was.last_seq) / seconds:.1f}"
        lines.append(f"{stage:<13} {s.messages:>9} {_size(s.bytes):>10} {rate:>8}")
    lines += [
        "",
        f"{'queue':<9} {'reads':<13} {'pending':>8} {'in flight':>10} {'redelivered':>12} "
        f"{'done/s':>8}",
    ]
    for role, q in now.queues.items():
        stage = next(c.name for c in topology.work_queues if c.work_queue.durable == role)
        if q is None:
            lines.append(f"{role:<9} {stage:<13} {'?':>8} {'?':>10} {'?':>12} {'?':>8}")
            continue
        was_q = before.queues.get(role)
        rate = "?" if was_q is None else f"{(q.done - was_q.done) / seconds:.1f}"
        lines.append(
            f"{role:<9} {stage:<13} {q.pending:>8} {q.in_flight:>10} {q.redelivered:>12} {rate:>8}"
        )
    dead = (
        "?"
        if now.dead is None
        else ", ".join(f"{stage} {n}" for stage, n in sorted(now.dead.items())) or "none"
    )
    lines += ["", f"dead letters: {dead}", lost_line(info.lost)]
    if info.drops is None:
        lines += ["dropped groups: ?", "reward failures: ?"]
    else:
        lines += [f"dropped groups: {info.drops.breakdown()}", failures_line(info.drops.failures)]
    members = info.members
    trainer_steps = [
        m.weight_version
        for m in members or []
        if m.role == "trainer" and m.weight_version is not None
    ]
    trainer = (
        "trainer step ?"
        if members is None
        else f"trainer at step {max(trainer_steps)}"
        if trainer_steps
        else "no live trainer"
    )
    weights = (
        "?"
        if "weights" in info.unknown
        else f"v{info.weights}"
        if info.weights is not None
        else "none yet"
    )
    staleness = "staleness: ?" if info.batches is None else staleness_line(info.batches)
    lines += [f"{trainer}; latest weights {weights}", staleness]
    lines += [info.stalled, ""] if info.stalled else [""]
    lines.append(f"workers: {'?' if members is None else len(members)} live")
    lines.append(
        f"{'role':<9} {'node':<20} {'pid':>8} {'engine':<7} {'weights':<9} {'up':>7} "
        f"{'last beat':>10}"
    )
    wall = time.time()
    for m in members or []:
        version = m.weight_version
        held = (
            "-" if version is None else f"step {version}" if m.role == "trainer" else f"v{version}"
        )
        lines.append(
            f"{m.role:<9} {m.node[:20]:<20} {m.pid:>8} {m.engine or '-':<7} {held:<9} "
            f"{_duration(wall - m.started_at):>7} {_duration(wall - m.updated_at) + ' ago':>10}"
        )
    return "\n".join(lines)


async def show(
    url: str, topology: Topology, watch: bool, batches: int, identity: Path | None = None
) -> None:
    """Print the page once (rates over 1 s), or redraw it every WATCH_SECONDS until
    SIGINT/SIGTERM."""
    # Ctrl-C sets an event rather than cancelling the task: a cancellation that lands inside a
    # client call can be swallowed there (Python 3.11's `wait_for` loses one that races with a
    # reply), and --watch then ignored Ctrl-C (1 run in 4 of its test). The event cannot be lost.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pages = asyncio.create_task(_draw(url, topology, watch, batches, stop, identity))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({pages, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not pages.done():  # interrupted: the page loop gets a moment to close its connection
        pages.cancel()
        await asyncio.wait({pages}, timeout=CLOSE_SECONDS)
    if pages.done() and not pages.cancelled():
        pages.result()  # re-raises what ended the loop (no such run, no server)


async def _draw(
    url: str,
    topology: Topology,
    watch: bool,
    batches: int,
    stop: asyncio.Event,
    identity: Path | None = None,
) -> None:
    # The bus connection retries forever, right for a worker;
    # a person asking for status wants an answer.
    nc = await asyncio.wait_for(connect(url, "ops-status", identity=identity), CONNECT_SECONDS)
    js = nc.jetstream()
    try:
        try:
            topology = await as_stored(js, topology)
        except nats.errors.Error as e:
            # No quorum for the run's KV (or no server answering): draw the default pipeline's
            # queues, each `?` where it cannot be read, rather than nothing.
            print(
                f"ops.status: run {topology.run}'s config unreadable ({e or type(e).__name__}): "
                "default queues shown",
                file=sys.stderr,
            )
        before = await sample(js, topology)
        while not stop.is_set():
            await asyncio.sleep(WATCH_SECONDS if watch else 1.0)
            now = await sample(js, topology)
            page = render(topology, before, now, await details(js, topology, batches))
            print(CLEAR + page if watch else page, flush=True)
            if not watch:
                return
            before = now
    finally:
        await nc.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ops.status", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run", type=run_id_arg, help="run id")
    parser.add_argument("--nats", help="NATS URL(s) (default: $JETRL_NATS_URL, then the local)")
    parser.add_argument(
        "--out",
        type=Path,
        help="a local job's run directory: its run, server and admin identity (not with --run)",
    )
    parser.add_argument(
        "--watch", action="store_true", help=f"redraw every {WATCH_SECONDS:.0f} s until Ctrl-C"
    )
    parser.add_argument(
        "--batches", type=int, default=16, help="recent batch events the staleness is measured over"
    )
    args = parser.parse_args(argv)
    args.identity = None
    if args.out is not None:
        if args.run is not None or args.nats is not None:
            parser.error("--out names the run and its server: give it without --run and --nats")
        try:
            server = read_server(args.out)
        except RunDirError as exc:
            parser.exit(1, f"ops.status: {exc}\n")
        args.run, args.nats, args.identity = server.run, server.url, server.identity
    elif args.run is None:
        parser.error("give --run R (with --nats URL), or --out DIR of a local job")
    args.nats = args.nats or os.environ.get("JETRL_NATS_URL", DEFAULT_URL)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    # The bus logs each failed connect and reconnect for a worker's log; here the page, or one
    # line saying why there is none, is the answer.
    logging.getLogger("jetrl.bus").setLevel(logging.ERROR)
    try:
        asyncio.run(
            show(args.nats, Topology(run=args.run), args.watch, args.batches, args.identity)
        )
    except NotFoundError:
        sys.exit(f"ops.status: run {args.run} has no streams on {args.nats}; is the run id right?")
    except (OSError, TimeoutError) as exc:
        reason = str(exc) or f"no answer in {CONNECT_SECONDS:.0f}s"
        hint = "" if args.out else " (a local job's server: give --out <its run directory>)"
        sys.exit(f"ops.status: cannot reach NATS at {args.nats}: {reason}{hint}")


if __name__ == "__main__":
    main()
