"""Tools that misbehave, and a reward that looks for an agent's files, for
tests/test_tool_runner.py (loaded by `module:function` name)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from typing import Any

TEN_MB = 10 << 20


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def hang(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def boom(message: str) -> str:
    """Raise.

    Args:
        message: The error's message.
    """
    raise RuntimeError(message)


def die(code: int) -> str:
    """End the process at once.

    Args:
        code: Its exit code.
    """
    os._exit(code)


def segfault() -> str:
    """Read address 0."""
    return str(ctypes.string_at(0))


def big_result() -> str:
    """Return 10 MB."""
    return "x" * TEN_MB


def big_print() -> str:
    """Print 10 MB to stdout."""
    sys.stdout.write("y" * TEN_MB)
    return "printed"


def chatty() -> str:
    """Print a little."""
    print("a little")
    return "fine"


def write_file(name: str, text: str) -> str:
    """Write a file in the working directory.

    Args:
        name: Its name.
        text: Its content.
    """
    with open(name, "w") as file:
        file.write(text)
    return os.path.abspath(name)


def read_file(path: str) -> str:
    """Read a file, relative to the working directory or absolute.

    Args:
        path: The file.
    """
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return "missing"


def sees_file(response_text: str, task: dict[str, Any]) -> float:
    """A reward: 1.0 if the agent's file (by the absolute path the tool gave, or by name in
    this process's working directory) is visible here."""
    return float(os.path.exists(task["path"]) or os.path.exists(task["name"]))


def remount_and_write(path: str) -> str:
    """Remount / read-write (as the user namespace's root could) and write `path`.

    Args:
        path: An absolute path on the read-only tree.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    ms_remount, ms_bind = 32, 4096
    if libc.mount(b"none", b"/", None, ms_remount | ms_bind, None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"remount /: {os.strerror(errno)}")
    with open(path, "w") as file:
        file.write("escaped")
    return "wrote"


def reward_remounts(response_text: str, task: dict[str, Any]) -> float:
    """A reward that tries `remount_and_write`."""
    remount_and_write(task["path"])
    return 1.0


def connect(port: int) -> str:
    """Open a TCP connection to a port on this host's loopback.

    Args:
        port: The port.
    """
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    return "connected"


def signal_pid(pid: int) -> str:
    """Send SIGUSR1 to a process.

    Args:
        pid: The process.
    """
    os.kill(pid, signal.SIGUSR1)
    return "sent"
