"""`python -m consumers.fleet --config fleet.yaml [--nats URL] [--run R]`:
run and supervise one node's workers.

The fleet starts `processes` processes of each configured role (`consumers.fleet_config`),
each `python -m consumers.<role> --run R --nats URL [args]` with its own log file and GPU(s),
and supervises them (`consumers.supervisor`):

    worker exits 0              done (the trainer after its last step), not restarted
    worker crashes or killed    restarted after `backoff`, doubled for every restart
                                already inside `window` (at most `max_backoff`)
    ... `max_restarts` already  given up on: logged as GAVE UP, with its log's tail
        inside the window
    nothing left running        exit 1 if any worker was given up on, else 0
    SIGTERM / SIGINT            SIGTERM every worker (they drain), SIGKILL those still
                                running after `stop_timeout`, exit 0

Workers get SIGTERM from Linux when the fleet dies without stopping them (kill -9), so a
restarted fleet never runs beside orphans of the last one.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from bus.connection import DEFAULT_URL
from bus.topology import run_id_arg
from consumers.fleet_config import load_fleet
from consumers.supervisor import Supervisor
from schemas.config import ConfigError


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m consumers.fleet", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--config", type=Path, required=True, help="fleet YAML (see examples/fleet.yaml)"
    )
    parser.add_argument(
        "--nats",
        help="NATS URL(s), comma separated (default: the YAML's, $JETRL_NATS_URL, localhost)",
    )
    parser.add_argument("--run", type=run_id_arg, help="run id (default: the YAML's run)")
    parser.add_argument(
        "--identities",
        type=Path,
        help="directory of the run's seeds (ops.streams users --out): each worker gets its role's",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fleet %(levelname)s %(message)s")
    try:
        config = load_fleet(args.config)
    except ConfigError as exc:
        sys.exit(f"consumers.fleet: {exc}")
    run = args.run or config.run
    if run is None:
        sys.exit(f"consumers.fleet: no run id: set `run:` in {args.config} or pass --run")
    url = args.nats or config.nats or os.environ.get("JETRL_NATS_URL", DEFAULT_URL)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return Supervisor(config, run, url, identities=args.identities).serve(stop)


if __name__ == "__main__":
    sys.exit(main())
