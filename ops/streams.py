"""`python -m ops.streams apply|show|delete|users --run R [--nats URL]`: a run's JetStream objects.

`users` needs no server: it writes the run's per-role NATS identities (bus.security) to the
directory --out: users.conf (public keys) and a seed file per role, readable by its owner only.
The other actions connect as $JETRL_NATS_IDENTITY (the admin seed, on a secured server).
`apply` and `delete` ride out a leader election (a node just died); both take the stream limits
the run's config in KV derives (the defaults before the producer stored one), and `show` prints
that derivation (`schemas.streams_config`) above each stream's state and limits, `?` for a
figure the server cannot give now.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from pathlib import Path

import yaml
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, NotFoundError

from bus.connection import DEFAULT_URL, connect
from bus.election import TRANSIENT, or_unknown, ride_out
from bus.lag import queue_lag
from bus.security import USERS_FILE, write_identities
from bus.topology import CHANNELS, CONFIG_KEY, Topology, run_id_arg
from schemas.config import ConfigError, RunConfig, parse_config
from schemas.streams_config import stream_needs

UNREACHABLE: tuple[type[BaseException], ...] = (OSError, *TRANSIENT)
"""What a command fails with when NATS cannot be reached (or has no leader for long)."""


async def stored_config(js: JetStreamContext, run: str) -> tuple[RunConfig, str]:
    """The run's config from its KV (the producer stores it), else the defaults; and which it is."""
    try:
        kv = await js.key_value(Topology(run=run).kv_bucket)
        entry = await kv.get(CONFIG_KEY)
    except (BucketNotFoundError, KeyNotFoundError, NotFoundError):
        return RunConfig(run=run), "no config stored yet: the defaults"
    return parse_config(
        yaml.safe_load(entry.value or b""), f"run {run} config in KV"
    ), "the run's config in KV"


async def as_stored(js: JetStreamContext, topology: Topology) -> Topology:
    """`topology` with the work queues its run's stored config gives it (the reference stage's or
    not): what an operator tool that starts from a run id reads the queues of."""
    config, _ = await stored_config(js, topology.run)
    return dataclasses.replace(topology, reference=config.reference.enabled)


def limits(config: RunConfig, origin: str) -> list[str]:
    """How each stream's limit follows from the run's bounds (`schemas.streams_config`)."""
    age = f"{config.streams.max_age_s:g} s" if config.streams.max_age_s else "none"
    lines = [f"limits from {origin} (age limit: {age}; consumed work: {config.streams.consumed}):"]
    for need in stream_needs(config).values():
        override = f", override {need.limit:,}" if need.limit != need.need else ""
        lines.append(f"  {need.stream:<13} need {need.need:>16,} B{override}: {need.how}")
    return lines


async def show(js: JetStreamContext, topology: Topology, config: RunConfig, origin: str) -> None:
    print("\n".join(limits(config, origin)))
    print()
    print(
        f"{'stream':<34} {'messages':>9} {'bytes':>12} {'max bytes':>16} {'discard':>7}  consumers"
    )
    lags = await queue_lag(js, topology)
    for channel in topology.channels:
        name = topology.stream(channel)
        try:
            info = await or_unknown(lambda: js.stream_info(name), f"stream {name}")  # noqa: B023
        except NotFoundError:
            print(f"{name:<34} {'(missing)':>9}")
            continue
        consumers = []
        if channel.queue is not None:
            lag = lags.get(channel.queue.durable)
            figures = "?" if lag is None else f"pending {lag.pending}, in flight {lag.in_flight}"
            consumers.append(f"{channel.queue.durable}: {figures}")
        messages, size = ("?", "?") if info is None else (info.state.messages, info.state.bytes)
        # nats-py gives the server's discard policy as a plain string ("new", "old").
        limit, discard = (
            ("?", "?") if info is None else (f"{info.config.max_bytes:,}", str(info.config.discard))
        )
        print(
            f"{name:<34} {messages:>9} {size:>12} {limit:>16} {discard:>7}  {'; '.join(consumers)}"
        )


def write_users(topology: Topology, out: str) -> None:
    """Write the run's identities to directory `out`: users.conf for the servers,
    a seed per role."""
    try:
        paths = write_identities(topology, Path(out))
    except OSError as exc:
        sys.exit(f"ops.streams: cannot write {out}: {exc.strerror}")
    print(
        f"wrote {Path(out) / USERS_FILE} (public keys; include it in each node's config) and the "
        f"seeds {', '.join(p.name for p in paths.values())} (mode 600; give each worker its own: "
        "--identity)",
        file=sys.stderr,
    )


async def main(args: argparse.Namespace) -> None:
    nc = await connect(args.nats, "ops-streams")
    js = nc.jetstream()
    config, origin = await ride_out(lambda: stored_config(js, args.run), "reading the run config")
    topology = Topology.for_config(config, args.replicas)
    if args.action == "apply":
        await ride_out(lambda: topology.apply(js, update=True), f"applying run {args.run}")
        print(
            f"applied run {args.run}: {len(CHANNELS)} streams, "
            f"{len(topology.work_queues)} consumers, KV and object store"
        )
    elif args.action == "delete":
        await ride_out(lambda: topology.delete(js), f"deleting run {args.run}")
        print(f"deleted run {args.run}")
    else:
        await show(js, topology, config, origin)
    await nc.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ops.streams", description=__doc__)
    parser.add_argument("action", choices=["apply", "show", "delete", "users"])
    parser.add_argument(
        "--run", required=True, type=run_id_arg, help="run id (letters, digits, _ and -)"
    )
    parser.add_argument(
        "--nats",
        default=os.environ.get("JETRL_NATS_URL", DEFAULT_URL),
        help="NATS URL(s), comma separated",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        choices=[1, 3, 5],
        default=1,
        help="stream replicas (3 on a cluster)",
    )
    parser.add_argument(
        "--out", help="users: directory to write users.conf and the seeds <role>.nk to"
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    if arguments.action == "users":
        if arguments.out is None:
            sys.exit(
                "ops.streams: users needs --out DIR (the seeds are written there, not printed)"
            )
        write_users(Topology(run=arguments.run), arguments.out)
        sys.exit()
    try:
        asyncio.run(main(arguments))
    except UNREACHABLE as exc:
        sys.exit(f"ops.streams: cannot reach NATS: {exc or type(exc).__name__}")
    except ConfigError as exc:
        sys.exit(f"ops.streams: {exc}")
