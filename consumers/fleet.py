"""`python -m consumers.fleet --config fleet.yaml [KEY.PATH=VALUE ...] [--nats URL] [--run R]
[--dry-run]`: run and supervise one node's workers.

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

KEY.PATH=VALUE arguments override the fleet YAML (`schemas.overrides`: `roles.rollout.processes=4`,
`restart.max_restarts=0`). `--dry-run` prints the resolved fleet YAML and every worker it would
start (command, environment, log), and starts none. The run's stream limits are not the fleet's:
they follow from the run config (`python -m producers.prompts --dry-run`, `ops.streams show`).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

import yaml

from bus.connection import DEFAULT_URL
from bus.topology import run_id_arg
from consumers.fleet_config import FleetConfig
from consumers.supervisor import Supervisor
from schemas.config import ConfigError
from schemas.overrides import (
    OverrideError,
    add_overrides_argument,
    help_epilog,
    load_with_overrides,
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    prog = "python -m consumers.fleet"
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=help_epilog(prog, "--config examples/fleet.yaml roles.rollout.processes=4"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    add_overrides_argument(parser, "fleet YAML")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved fleet and the workers it would start, and start none",
    )
    return parser.parse_intermixed_args(argv)


def workers(supervisor: Supervisor) -> dict[str, dict[str, object]]:
    """What each worker of the fleet would be started with (the dry run's second document)."""
    return {
        child.name: {
            "command": shlex.join(child.command),
            "env": child.env,
            "log": str(child.log),
        }
        for child in supervisor.children.values()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fleet %(levelname)s %(message)s")
    try:
        config = load_with_overrides(FleetConfig, args.config, args.overrides)
    except OverrideError as exc:
        print(f"consumers.fleet: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        sys.exit(f"consumers.fleet: {exc}")
    run = args.run or config.run
    if run is None:
        sys.exit(f"consumers.fleet: no run id: set `run:` in {args.config} or pass --run")
    url = args.nats or config.nats or os.environ.get("JETRL_NATS_URL", DEFAULT_URL)
    if args.dry_run:
        supervisor = Supervisor(config, run, url, identities=args.identities)  # starts nothing
        print("# the resolved fleet (docs/config.md)")
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        print(f"---\n# the workers it would start for run {run} at {url}")
        print(yaml.safe_dump({"workers": workers(supervisor)}, sort_keys=False, width=100), end="")
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return Supervisor(config, run, url, identities=args.identities).serve(stop)


if __name__ == "__main__":
    sys.exit(main())
