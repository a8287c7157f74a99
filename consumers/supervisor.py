"""The process supervisor: starts a fleet's workers and keeps them running.

One pass every POLL_SECONDS:

    worker exits 0              done (the trainer after its last step), not restarted
    worker crashes or killed    restarted after `backoff`, doubled for every restart
                                already inside `window` (at most `max_backoff`)
    ... `max_restarts` already  given up on: logged as GAVE UP, with its log's tail
        inside the window
    check                       raises FleetFailed once one is given up on: every worker that
                                is failing, each with its one-line reason, the root cause
                                first (consumers/failures.py)
    stop                        SIGTERM every worker (they drain), SIGKILL those still
                                running after `stop_timeout`

Workers get SIGTERM from Linux when the supervisor dies without stopping them (kill -9), so
a restarted fleet never runs beside orphans of the last one.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from bus.identity import IDENTITY_ENV, identity_path
from consumers.failures import Failure, reason_line, stop_message
from consumers.fleet_config import ROLES, FleetConfig, worker_name
from engines.device import DEVICE_ENV

log = logging.getLogger("jetrl.fleet")

POLL_SECONDS = 0.2
LOG_TAIL_LINES = 15
LOG_TAIL_BYTES = 8192
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Loaded before any fork: a child between fork and exec must not take the loader's lock.
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None

State = Literal["running", "waiting", "done", "gave up", "stopped"]


def _term_with_parent(parent: int) -> None:
    """In the child before exec: ask Linux for SIGTERM when the fleet dies."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the fleet died before the request above took effect
        os._exit(0)


def _tail(path: Path) -> str:
    """The last lines of a log, read from its end: a long run's log can be large."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
        return "\n".join(f.read().decode(errors="replace").splitlines()[-LOG_TAIL_LINES:])


def _how(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"


@dataclass
class Child:
    """One worker slot: how to start it, its current process, and its restart history."""

    name: str
    """`<role>-<index>`; also the log file's name."""
    command: list[str]
    env: dict[str, str]
    """Added to the fleet's own environment."""
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    state: State = "waiting"
    restart_at: float = 0.0
    """Monotonic time a waiting worker is (re)started at."""
    restarts: list[float] = field(default_factory=list)
    """Monotonic times of its restarts, for the window count."""
    reason: str = ""
    """Why it was given up on, with its log's tail."""
    stage: str = ""
    """The module it runs, without `consumers.` (`trainer` for a trainer's other ranks)."""
    failure: str = ""
    """Its last failed exit's one-line reason (`failures.reason_line`), or how it ended."""
    failed: list[float] = field(default_factory=list)
    """Monotonic times of its failed exits inside the restart window (cleared by an exit 0)."""
    last_exit: str = ""
    """How its process last ended (`exited with 1`)."""


class FleetFailed(RuntimeError):
    """A worker was given up on; the message is `failures.stop_message`: its first line the root
    cause (`worker: reason`), then every failing worker's line, root cause first."""

    def __init__(self, failures: list[Failure], logs: Path) -> None:
        super().__init__(stop_message(failures, str(logs)))
        self.failures = failures


def identity_role(role: str, module: str) -> str:
    """Whose identity a fleet role's workers connect with: the stage its module runs
    (`trainer-rank1` runs `consumers.trainer`: a trainer), else the role's own name."""
    stage = module.removeprefix("consumers.")
    return stage if module.startswith("consumers.") and stage in ROLES else role


class Supervisor:
    """Starts a fleet's workers and keeps them running. `start`, then `poll` in a loop, then `stop`.

    Use it from one thread: Linux sends the death signal when the *thread* that started a
    worker exits, not the process.
    """

    def __init__(
        self,
        config: FleetConfig,
        run: str,
        url: str,
        names: Collection[str] | None = None,
        identities: Path | None = None,
    ) -> None:
        """`names`: the workers (`<role>-<index>`) of the fleet to run; default every one.
        `identities`: a directory of seeds (`ops.streams users --out`); each worker is given
        its role's (`<role>.nk`) by path in $JETRL_NATS_IDENTITY, never the secret itself."""
        self.config = config
        self.children: dict[str, Child] = {}
        for role, spec in config.roles.items():
            module = spec.module or f"consumers.{role}"
            command = [sys.executable, "-m", module, "--run", run, "--nats", url, *spec.args]
            for index in range(spec.processes):
                env = dict(spec.env)
                if identities is not None:
                    env[IDENTITY_ENV] = str(identity_path(identity_role(role, module), identities))
                if spec.devices:
                    env["CUDA_VISIBLE_DEVICES"] = str(spec.devices[index % len(spec.devices)])
                if spec.device is not None:
                    env[DEVICE_ENV] = spec.device
                name = worker_name(role, index)
                if names is None or name in names:
                    self.children[name] = Child(
                        name,
                        command,
                        env,
                        config.logs / f"{name}.log",
                        stage=module.removeprefix("consumers."),
                    )

    def start(self) -> None:
        self.config.logs.mkdir(parents=True, exist_ok=True)
        for child in self.children.values():
            self._spawn(child)

    def poll(self) -> None:
        """One pass: note exited workers, (re)start those whose backoff is over."""
        now = time.monotonic()
        for child in self.children.values():
            if (
                child.state == "running"
                and child.proc is not None
                and (code := child.proc.poll()) is not None
            ):
                self._exited(child, code, now)
            elif child.state == "waiting" and now >= child.restart_at:
                self._spawn(child)

    def check(self) -> None:
        """`poll`, then raise FleetFailed if a worker was given up on (for a job that needs every
        worker): it names every failing worker's reason, the root cause first."""
        self.poll()
        if any(child.state == "gave up" for child in self.children.values()):
            raise FleetFailed(self.failures(), self.config.logs)

    def failures(self, now: float | None = None) -> list[Failure]:
        """The workers failing now: given up on, or whose last exit failed inside the restart
        window (one that failed long ago and has run since is not)."""
        now = time.monotonic() if now is None else now
        window = self.config.restart.window
        return [
            Failure(
                worker=child.name,
                stage=child.stage,
                reason=child.failure,
                since=child.failed[0],
                how=f"{child.last_exit}, failed {len(child.failed)}x",
                gave_up=child.state == "gave up",
            )
            for child in self.children.values()
            if child.failed and (child.state == "gave up" or now - child.failed[-1] < window)
        ]

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send `sig` to one worker (chaos tests); the next `poll` sees it exit and acts."""
        proc = self.children[name].proc
        if proc is not None:
            proc.send_signal(sig)

    def pid(self, name: str) -> int | None:
        proc = self.children[name].proc
        return proc.pid if proc is not None and self.children[name].state == "running" else None

    @property
    def finished(self) -> bool:
        """Nothing is running or waiting to be restarted."""
        return all(
            child.state in ("done", "gave up", "stopped") for child in self.children.values()
        )

    @property
    def gave_up(self) -> list[str]:
        return [name for name, child in self.children.items() if child.state == "gave up"]

    def stop(self) -> None:
        """SIGTERM every running worker (they drain), SIGKILL those still running after
        stop_timeout."""
        running = {
            c.name: c.proc
            for c in self.children.values()
            if c.state == "running" and c.proc is not None
        }
        for proc in running.values():
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout
        for name, proc in running.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s still running %.0fs after SIGTERM: SIGKILL", name, self.config.stop_timeout
                )
                proc.kill()
                proc.wait()
        for child in self.children.values():
            if child.state in ("running", "waiting"):
                child.state = "stopped"

    def serve(self, stop: threading.Event) -> int:
        """The fleet's loop: start, supervise until `stop` is set or nothing is left, stop;
        the exit code."""
        self.start()
        while not stop.is_set() and not self.finished:
            self.poll()
            stop.wait(POLL_SECONDS)
        self.stop()
        if stop.is_set() or not self.gave_up:
            return 0
        log.error("every worker has exited; gave up on %s", ", ".join(self.gave_up))
        return 1

    def _spawn(self, child: Child) -> None:
        with open(child.log, "ab") as out:
            out.write(
                f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} "
                f"fleet starts {' '.join(child.command)}\n".encode()
            )
            out.flush()
            child.proc = subprocess.Popen(
                child.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **child.env},
                preexec_fn=functools.partial(_term_with_parent, os.getpid()),
            )
        child.state = "running"
        log.info("%s started (pid %d)", child.name, child.proc.pid)

    def _exited(self, child: Child, code: int, now: float) -> None:
        child.last_exit = _how(code)
        if code == 0:
            child.failed, child.failure = [], ""
            child.state = "done"
            log.info("%s exited 0: done", child.name)
            return
        try:
            child.failure = reason_line(_tail(child.log)) or child.last_exit
        except OSError:
            child.failure = child.last_exit
        policy = self.config.restart
        child.failed = [t for t in child.failed if now - t < policy.window] + [now]
        child.restarts = [t for t in child.restarts if now - t < policy.window]
        if len(child.restarts) >= policy.max_restarts:
            child.state = "gave up"
            child.reason = (
                f"GAVE UP on {child.name}: {_how(code)} after {len(child.restarts)} restarts in "
                f"{policy.window:.0f}s; last lines of {child.log}:\n{_tail(child.log)}"
            )
            log.error("%s", child.reason)
            return
        delay = min(policy.backoff * 2 ** len(child.restarts), policy.max_backoff)
        child.restarts.append(now + delay)
        child.state, child.restart_at = "waiting", now + delay
        log.warning(
            "%s %s: restart %d in %.1fs", child.name, _how(code), len(child.restarts), delay
        )
