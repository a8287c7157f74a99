"""`python -m ops.streams apply|show|delete --run R [--nats URL]`: a run's JetStream objects."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from bus.connection import DEFAULT_URL, connect
from bus.topology import STAGES, Topology, run_id_arg


async def show(js: JetStreamContext, topology: Topology) -> None:
    print(f"{'stream':<34} {'messages':>9} {'bytes':>12}  consumers")
    for stage in STAGES:
        try:
            info = await js.stream_info(topology.stream(stage))
        except NotFoundError:
            print(f"{topology.stream(stage):<34} {'(missing)':>9}")
            continue
        consumers = []
        for queue in topology.queues.values():
            if queue.stage == stage:
                c = await js.consumer_info(topology.stream(stage), queue.durable)
                consumers.append(f"{queue.durable}: pending {c.num_pending}, in flight {c.num_ack_pending}")
        print(f"{topology.stream(stage):<34} {info.state.messages:>9} {info.state.bytes:>12}  {'; '.join(consumers)}")


async def main(args: argparse.Namespace) -> None:
    nc = await connect(args.nats, "ops-streams")
    js = nc.jetstream()
    topology = Topology(run=args.run, replicas=args.replicas)
    if args.action == "apply":
        await topology.apply(js)
        print(f"applied run {args.run}: {len(STAGES)} streams, {len(topology.queues)} consumers, KV and object store")
    elif args.action == "delete":
        await topology.delete(js)
        print(f"deleted run {args.run}")
    else:
        await show(js, topology)
    await nc.close()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ops.streams", description=__doc__)
    parser.add_argument("action", choices=["apply", "show", "delete"])
    parser.add_argument("--run", required=True, type=run_id_arg, help="run id (letters, digits, _ and -)")
    parser.add_argument("--nats", default=os.environ.get("JETRL_NATS_URL", DEFAULT_URL), help="NATS URL(s), comma separated")
    parser.add_argument("--replicas", type=int, choices=[1, 3, 5], default=1, help="stream replicas (3 on a cluster)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    try:
        asyncio.run(main(parse()))
    except (OSError, asyncio.TimeoutError) as exc:
        sys.exit(f"ops.streams: cannot reach NATS: {exc}")
