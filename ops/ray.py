"""`python -m ops.ray up|down fleet.yaml [KEY.PATH=VALUE ...] [--address ADDR] [--nats URL]`:
a fleet's workers as Ray actors.

`up` starts the workers a fleet YAML describes (`consumers.fleet_config.FleetConfig`, the file
`python -m consumers.fleet` takes) across a Ray cluster instead of on one node: one
detached, named actor per worker, placed by its role's `num_cpus` and `num_gpus`. Inside
its actor the worker is what a fleet runs: `python -m <module> --run R --nats URL [args]`
as a child process with its log in `<logs>/<role>-<index>.log` on that node, restarted
with backoff or given up on by a one-worker `Supervisor`. `up` prints where each worker
runs and exits 1 if one could not be started or placed (an unplaced one starts when the
cluster has room); running it again starts only what is missing.

`down` finds the same actors by name and drains them: SIGTERM to each worker (it stops
fetching and finishes its in-flight work), SIGKILL after the fleet's `stop_timeout`, then
removes the actor. It prints how each worker ended and exits 1 if one did not end cleanly.

Actors are named `<run>/<fleet>/<role>-<index>` in Ray namespace `jetrl`, `<fleet>` being
the YAML's file name without `.yaml`: two fleet files of one run (a whole run, then more
rollout workers) never share a worker, and `down` stops only its own file's.
KEY.PATH=VALUE arguments override the YAML as they do for `consumers.fleet` (`schemas.overrides`).

Unlike `consumers.fleet`: Ray picks each worker's GPUs (`devices` is ignored); a relative
`logs` is taken from the directory `up` runs in; a worker whose actor dies (its node
lost) is started again by Ray wherever there is room. Every node needs jetrl installed,
as for a fleet.

Ray is the optional `[ray]` extra: it is imported only inside the functions that use it.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from bus.connection import DEFAULT_URL
from consumers.fleet_config import FleetConfig, RoleConfig, worker_name
from consumers.supervisor import POLL_SECONDS, State, Supervisor
from schemas.config import ConfigError
from schemas.overrides import (
    OverrideError,
    add_overrides_argument,
    help_epilog,
    load_with_overrides,
)

if TYPE_CHECKING:
    from ray.actor import ActorHandle

NAMESPACE = "jetrl"
"""Ray namespace of every worker actor: `down` from another driver finds them by name there."""
START_TIMEOUT = 300.0
"""Seconds `up` waits for every worker to be placed and started."""
DRAIN_MARGIN = 30.0
"""Seconds `down` waits beyond `stop_timeout` for an actor to report how its worker ended."""


class WorkerActor:
    """One fleet worker, run by a Ray actor: a one-worker `Supervisor` serving in a thread of its
    own.

    The worker is a child process, not a coroutine in the actor, so that it keeps its own
    SIGTERM handler (stop fetching, drain in-flight work) and its own event loop. The thread
    that starts it must outlive it (Linux sends the worker SIGTERM when that thread exits,
    see `consumers.fleet`), hence a dedicated thread rather than Ray's method-call thread.
    """

    def __init__(self, config: FleetConfig, run: str, url: str, name: str) -> None:
        self.name = name
        self.supervisor = Supervisor(config, run, url, names=[name])
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self.supervisor.serve, args=(self.stop,), name=name, daemon=True
        )
        self.thread.start()

    def started(self) -> str:
        """Where the worker runs ("pid P on HOST"), once its process has been started."""
        child = self.supervisor.children[self.name]
        while child.proc is None and self.thread.is_alive():
            time.sleep(POLL_SECONDS)
        if child.proc is None:
            raise RuntimeError(f"{self.name} was not started; see the Ray worker log of this actor")
        return f"pid {child.proc.pid} on {socket.gethostname()}"

    def drain(self) -> tuple[State, int | None]:
        """SIGTERM the worker and wait for it (SIGKILL after stop_timeout):
        its last state and exit code."""
        self.stop.set()
        self.thread.join()
        child = self.supervisor.children[self.name]
        return child.state, None if child.proc is None else child.proc.returncode


def workers(config: FleetConfig) -> Iterator[tuple[str, RoleConfig]]:
    """Every worker of the fleet: its name and its role's settings."""
    for role, spec in config.roles.items():
        for index in range(spec.processes):
            yield worker_name(role, index), spec


def actor_name(run: str, fleet: str, worker: str) -> str:
    """The Ray name of a worker's actor: `<run>/<fleet>/<role>-<index>`."""
    return f"{run}/{fleet}/{worker}"


def for_ray(config: FleetConfig) -> FleetConfig:
    """The fleet as its actors run it: GPUs left to Ray, logs at an absolute path."""
    roles = {role: spec.model_copy(update={"devices": []}) for role, spec in config.roles.items()}
    return config.model_copy(update={"roles": roles, "logs": config.logs.resolve()})


def up(config: FleetConfig, fleet: str, run: str, url: str, timeout: float = START_TIMEOUT) -> int:
    """Start the missing worker actors of fleet `fleet`, wait until each runs; 0 if all do,
    else 1."""
    import ray

    ray_fleet = for_ray(config)
    starting: dict[ray.ObjectRef, tuple[str, RoleConfig]] = {}
    for name, spec in workers(ray_fleet):
        actor = (
            ray.remote(WorkerActor)
            .options(
                name=actor_name(run, fleet, name),
                namespace=NAMESPACE,
                lifetime="detached",
                get_if_exists=True,
                num_cpus=spec.num_cpus,
                num_gpus=spec.num_gpus,
                max_restarts=-1,  # its node lost: Ray starts it again elsewhere
            )
            .remote(ray_fleet, run, url, name)
        )
        # Ray adds `.remote` to an actor handle's methods at runtime; its types do not say so.
        starting[actor.started.remote()] = (name, spec)  # type: ignore[attr-defined]
    ready, _ = ray.wait(list(starting), num_returns=len(starting), timeout=timeout)
    failed = False
    for ref, (name, spec) in starting.items():
        if ref not in ready:
            failed = True
            print(
                f"{name}: not placed in {timeout:.0f}s (needs {spec.num_cpus:g} CPU, "
                f"{spec.num_gpus:g} GPU); it starts when the cluster has room, or `down` removes it"
            )
            continue
        try:
            print(f"{name}: {ray.get(ref)}")
        except ray.exceptions.RayError as exc:
            failed = True
            print(f"{name}: failed to start: {str(exc).strip().splitlines()[-1]}")
    return 1 if failed else 0


def down(config: FleetConfig, fleet: str, run: str) -> int:
    """Drain and remove the worker actors of fleet `fleet`; 0 if every worker ended cleanly,
    else 1."""
    import ray

    draining: dict[ray.ObjectRef, tuple[str, ActorHandle]] = {}
    for name, _ in workers(config):
        try:
            actor = ray.get_actor(actor_name(run, fleet, name), namespace=NAMESPACE)
        except ValueError:
            print(f"{name}: not up")
            continue
        draining[actor.drain.remote()] = (name, actor)
    wait = config.stop_timeout + DRAIN_MARGIN
    ready, _ = (
        ray.wait(list(draining), num_returns=len(draining), timeout=wait) if draining else ([], [])
    )
    failed = False
    for ref, (name, actor) in draining.items():
        if ref in ready:
            try:
                ended, clean = describe(*ray.get(ref))
            except ray.exceptions.RayError as exc:
                ended, clean = f"its actor failed: {str(exc).strip().splitlines()[-1]}", False
        else:
            # Removing the actor still stops its worker (SIGTERM from Linux when its parent dies).
            ended, clean = f"no answer in {wait:.0f}s (never placed?)", False
        failed |= not clean
        print(f"{name}: {ended}")
        ray.kill(actor, no_restart=True)
    return 1 if failed else 0


def describe(state: State, code: int | None) -> tuple[str, bool]:
    """How a worker ended, from its supervisor's last state and its exit code;
    and whether cleanly."""
    if state == "done":
        return "had finished (exit 0)", True
    if state == "gave up":
        return f"had been given up on (exit {code}); see its log", False
    return ("drained (exit 0)", True) if code == 0 else (f"did not drain (exit {code})", False)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    prog = "python -m ops.ray"
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog=help_epilog(prog, "up examples/fleet.yaml roles.rollout.processes=4"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "action", choices=["up", "down"], help="start the fleet's workers, or drain and remove them"
    )
    parser.add_argument("config", type=Path, help="fleet YAML (docs/config.md); it must set `run`")
    add_overrides_argument(parser, "fleet YAML")
    parser.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS", "auto"),
        help="Ray cluster HOST:PORT (default: $RAY_ADDRESS, then the one `ray start` began here)",
    )
    parser.add_argument(
        "--nats",
        help="NATS URL(s) the workers use (default: the YAML's, $JETRL_NATS_URL, localhost)",
    )
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        config = load_with_overrides(FleetConfig, args.config, args.overrides)
    except OverrideError as exc:
        print(f"ops.ray: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        sys.exit(f"ops.ray: {exc}")
    if config.run is None:
        sys.exit(f"ops.ray: no run id: set `run:` in {args.config}")
    import ray

    try:
        # The workers' own logs are in their log files; the CLI prints one line per worker.
        ray.init(
            address=args.address,
            namespace=NAMESPACE,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except ConnectionError as exc:  # no cluster there: say so in one line, not a traceback
        sys.exit(f"ops.ray: {exc}")
    try:
        if args.action == "up":
            url = args.nats or config.nats or os.environ.get("JETRL_NATS_URL", DEFAULT_URL)
            return up(config, args.config.stem, config.run, url)
        return down(config, args.config.stem, config.run)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
