"""The child side shared by every sandboxed process: the reward process
(consumers/reward_child.py) and the tool process (consumers/tool_child.py).

    parent (consumers/sandbox_process.py) --init, then one request at a time--> stdin
    parent <-- one reply per request -- stdout

`begin` does what both children do before they serve: move the protocol to private
descriptors (so a function that prints cannot corrupt it), read the init message, take the
worker's import path, die with the worker, enter the sandbox the parent chose
(consumers/reward_sandbox.py) and set the rlimits. Messages are length-prefixed msgpack
(`HEADER` + body), never pickle: the parent must not run code on the child's say-so. This
module imports only what a child needs; the parent takes `HEADER` and `frame` from here.
"""

from __future__ import annotations

import ctypes
import math
import os
import resource
import signal
import struct
import sys
from typing import Any, BinaryIO

import msgpack

from consumers import reward_sandbox

HEADER = struct.Struct(">I")
"""The length prefix of every framed message, both ways."""
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
SANDBOX_FAILED = 70
"""The exit code of a child whose sandbox could not be made (a half-made one is none)."""


def frame(message: object) -> bytes:
    """`message` as msgpack behind its length prefix."""
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def begin() -> tuple[BinaryIO, BinaryIO, dict[str, Any]] | None:
    """The protocol's (requests, replies) streams and the init message, once this process is
    what the parent asked for; None when the parent closed the pipe first."""
    requests, replies = claim_protocol_fds()
    init = receive(requests)
    if init is None:
        return None
    sys.path[:] = init["sys_path"]
    die_with_parent(init["parent"])
    if init["sandbox"] is not None:
        sys.dont_write_bytecode = True  # the tree is read-only now
        try:
            sandbox = init["sandbox"]
            reward_sandbox.enter(
                sandbox["tmp"], sandbox["processes"], sandbox["hide"], sandbox["keep"]
            )
        except OSError as exc:  # a sandbox half made is no sandbox: the parent reports the exit
            print(f"sandbox: {exc}", file=sys.stderr)
            os._exit(SANDBOX_FAILED)
    set_limit(resource.RLIMIT_AS, init["memory"])
    set_limit(resource.RLIMIT_FSIZE, init["file"])
    set_limit(resource.RLIMIT_CORE, 0)  # a crashing function must not fill the disk with cores
    return requests, replies, init


def claim_protocol_fds() -> tuple[BinaryIO, BinaryIO]:
    """Keep stdin/stdout for the protocol on private descriptors; fd 0 becomes /dev/null,
    fd 1 stderr."""
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return requests, replies


def receive(stream: BinaryIO) -> Any:
    """The next framed message, or None when the parent has closed the pipe."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    return msgpack.unpackb(stream.read(size), raw=False)


def die_with_parent(parent: int) -> None:
    """Ask Linux for SIGKILL when the worker dies: a hung call must not outlive it."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the worker died before the request above took effect
        os._exit(0)


def set_limit(kind: int, soft: int, keep_hard: bool = False) -> None:
    """Set a soft limit, never above the inherited hard one, and lower the hard one to it
    unless `keep_hard` (so the function cannot raise the limit again)."""
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(kind, (soft, hard if keep_hard else soft))


def renew_cpu_limit(seconds: int) -> None:
    """Allow `seconds` more CPU time: RLIMIT_CPU counts the process's whole life, not one call."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # The hard limit stays where it was: a lowered one could not be raised for the next call.
    set_limit(
        resource.RLIMIT_CPU, math.ceil(usage.ru_utime + usage.ru_stime) + seconds, keep_hard=True
    )


def describe(exc: BaseException) -> str:
    """An exception as `Type: message` (or its type alone)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
