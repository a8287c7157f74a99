"""Reward functions that misbehave in every way the reward pool must survive.

Each takes `(response_text, task)` like a real reward function. `reverse_or_misbehave`
is the run's function in the end-to-end tests: it scores the `reverse` task unless the
task names one of the misbehaviours below. `length` is a well-behaved one for runs that
measure throughput.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from consumers.reward_pool import SCRUBBED_PREFIXES
from producers.tasks import score_reverse

NOT_CALLABLE = 42


def hang(response_text: str, task: dict[str, Any]) -> float:
    """Sleeps for an hour; writes its pid to task["pid_file"] first if asked to."""
    if "pid_file" in task:
        Path(task["pid_file"]).write_text(str(os.getpid()))
    time.sleep(3600)
    return 1.0


def slow(response_text: str, task: dict[str, Any]) -> float:
    """Takes task["seconds"] (a reward model's latency): long enough to be caught in flight."""
    time.sleep(float(task["seconds"]))
    return 1.0


def raise_error(response_text: str, task: dict[str, Any]) -> float:
    raise ValueError("no answer found")


def sys_exit(response_text: str, task: dict[str, Any]) -> float:
    sys.exit(3)


def segfault(response_text: str, task: dict[str, Any]) -> float:
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)  # the signal is delivered asynchronously
    return 1.0


def null_pointer(response_text: str, task: dict[str, Any]) -> float:
    ctypes.string_at(0)
    return 1.0


def allocate(response_text: str, task: dict[str, Any]) -> float:
    hoard = []
    while True:
        # Zeroed bytes come from untouched pages: the address space runs out in milliseconds,
        # where filling real memory would take the test seconds.
        hoard.append(bytes(64 << 20))


def nan(response_text: str, task: dict[str, Any]) -> float:
    return float("nan")


def infinite_component(response_text: str, task: dict[str, Any]) -> dict[str, float]:
    return {"reward": 1.0, "length": float("inf")}


def string(response_text: str, task: dict[str, Any]) -> str:
    return "1.0"


def huge_file(response_text: str, task: dict[str, Any]) -> float:
    chunk = b"x" * (1 << 20)
    Path(task["dir"]).mkdir(parents=True, exist_ok=True)  # a sandboxed process has its own /tmp
    with open(Path(task["dir"]) / "huge.bin", "wb") as out:
        while True:
            out.write(chunk)


def print_noise(response_text: str, task: dict[str, Any]) -> float:
    """Writes to stdout, which must not corrupt the pool's protocol."""
    print("\x00\x00\x00\x05garbage", flush=True)
    return 0.5


def sees_credentials(response_text: str, task: dict[str, Any]) -> float:
    """1.0 if any worker variable is visible, in os.environ or in the exec-time environment."""
    exec_time = Path("/proc/self/environ")
    names = list(os.environ)
    if exec_time.exists():  # Linux: what the process was started with, whatever os.environ says now
        names += [
            entry.partition("=")[0] for entry in exec_time.read_text(errors="replace").split("\0")
        ]
    return 1.0 if any(name.startswith(SCRUBBED_PREFIXES) for name in names) else 0.0


def limits(response_text: str, task: dict[str, Any]) -> dict[str, float]:
    """The process's address-space and file-size limits, as components of a 1.0 reward."""
    return {
        "reward": 1.0,
        "memory": float(resource.getrlimit(resource.RLIMIT_AS)[0]),
        "file": float(resource.getrlimit(resource.RLIMIT_FSIZE)[0]),
    }


def reverse_or_misbehave(response_text: str, task: dict[str, Any]) -> object:
    if "misbehave" in task:
        return globals()[task["misbehave"]](response_text, task)
    return score_reverse(response_text, task)


def length(response_text: str, task: dict[str, Any]) -> float:
    """The response's length: sampled responses differ in length, so a group's rewards are
    rarely all equal and few groups are dropped; a run's work is about known in advance."""
    return float(len(response_text))


# --- escapes: what code a reward executes might try. Each returns 1.0 when it got out. ----


def connect_bus(response_text: str, task: dict[str, Any]) -> float:
    """Open a TCP connection to the run's NATS port and read the server's INFO line."""
    import socket

    with socket.create_connection(("127.0.0.1", int(task["port"])), timeout=2) as conn:
        return 1.0 if conn.recv(4096).startswith(b"INFO") else 0.0


def read_worker_proc(response_text: str, task: dict[str, Any]) -> float:
    """Look for task["secret"] in the cmdline and environ of the parent and of task["pids"]."""
    seen = b""
    for pid in (os.getppid(), *task["pids"]):
        for name in ("cmdline", "environ"):
            with suppress(OSError):
                seen += Path(f"/proc/{pid}/{name}").read_bytes()
    return 1.0 if task["secret"].encode() in seen else 0.0


def write_outside(response_text: str, task: dict[str, Any]) -> float:
    """Write task["path"], a file outside any temporary directory."""
    Path(task["path"]).write_text("escaped")
    return 1.0


def fork_bomb(response_text: str, task: dict[str, Any]) -> float:
    """Fork task["count"] children that sleep (a bounded bomb: the test machine is shared)."""
    for _ in range(int(task["count"])):
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
    return 1.0


def read_identity(response_text: str, task: dict[str, Any]) -> float:
    """Read the worker's seed file, at task["path"]."""
    return 1.0 if Path(task["path"]).read_bytes() else 0.0


def logged(response_text: str, task: dict[str, Any]) -> object:
    """The response's length, each call logged as a line in task["log"]; misbehaves like
    `reverse_or_misbehave` when the task says so (and logs nothing then)."""
    if "misbehave" in task:
        return globals()[task["misbehave"]](response_text, task)
    with open(task["log"], "a") as log:
        log.write(response_text + "\n")
    return float(len(response_text))


def key_error(response_text: str, task: dict[str, Any]) -> float:
    """A user's bug: reads a task field the dataset does not have (KeyError: 'expected')."""
    return float(response_text == task["expected"])
