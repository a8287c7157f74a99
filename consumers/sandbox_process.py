"""A sandboxed child process, parent side: started, asked, timed out, killed, and its death
told in one line. The reward pool (consumers/reward_pool.py) and the tool runner
(consumers/tool_runner.py) both run untrusted code through it; one mechanism, two children
(consumers/reward_child.py, consumers/tool_child.py) that share their start-up
(consumers/sandbox_child.py).

Each process is a fresh interpreter (`python -m <child module>`) started with:
- an environment without the worker's NATS_/JETRL_/OTEL_ variables: they are left out when
  the process is exec'ed, so they are not in `/proc/self/environ` either; and none of the
  worker's open descriptors (its NATS socket);
- limits on address space (MemoryError), file size (the write fails with EFBIG) and core
  size, and a CPU-time limit renewed before each request (SIGXCPU past it);
- its own session, and (Linux) SIGKILL when the worker dies, so a hung call never outlives
  the worker and a kill of the whole group takes anything the function started along;
- where the caller chose it (`reward_sandbox.choose`), new user, network, pid and mount
  namespaces: no network, no other process's /proc, a private /tmp and the rest of the
  filesystem read-only, and a bound on the processes it may fork.

A request that times out, or whose process dies or breaks the protocol, kills the process
and raises `ChildLost` with the reason (`timed out after 2s`, `tool process killed by
SIGSEGV`, `reward process exited with code 3`); the caller starts a new one.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import os
import signal
import sys
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import msgpack

from bus.identity import IDENTITY_ENV
from consumers import reward_sandbox
from consumers.sandbox_child import HEADER, PR_SET_PDEATHSIG, frame

SCRUBBED_PREFIXES = ("NATS_", "JETRL_", "OTEL_")
"""Environment variables a sandboxed process must not see (connection URLs, credentials)."""
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class Limits:
    """Resource limits of every sandboxed process."""

    memory_bytes: int = 2 << 30
    """Address space (RLIMIT_AS); past it allocations raise MemoryError."""
    file_bytes: int = 16 << 20
    """Largest file the process may write (RLIMIT_FSIZE)."""
    cpu_factor: float = 3.0
    """CPU seconds one request may use, as a multiple of its deadline (RLIMIT_CPU)."""
    processes: int = 64
    """Processes a sandboxed process may have at once, itself included (RLIMIT_NPROC,
    counted in its own user namespace; without isolation it is not set)."""
    tmp_bytes: int = 64 << 20
    """Size of a sandboxed process's private /tmp (and /dev/shm), its only writable directory."""


def one_line(text: str) -> str:
    """`text` on one line, cut to MAX_REASON_CHARS (reasons travel in events and headers)."""
    return " ".join(text.split())[:MAX_REASON_CHARS]


def child_env() -> dict[str, str]:
    """The worker's environment without the variables a sandboxed process must not see."""
    return {
        key: value for key, value in os.environ.items() if not key.startswith(SCRUBBED_PREFIXES)
    }


class ChildLost(Exception):
    """A request that ended with its process killed or dead; the message is the reason."""


class BadReply(Exception):
    """A reply that breaks the protocol; the process can no longer be trusted to frame one."""


class SandboxProcess:
    """One sandboxed process (parent side) and the functions it has imported."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        limits: Limits,
        sandboxed: bool,
        what: str,
        max_reply_bytes: int,
    ) -> None:
        self.proc = proc
        self.limits = limits
        self.sandboxed = sandboxed
        self.what = what
        """What the process is, in its reasons (`reward process`, `tool process`)."""
        self.max_reply_bytes = max_reply_bytes
        self.resolved: set[str] = set()

    @classmethod
    async def spawn(
        cls,
        module: str,
        limits: Limits,
        sandboxed: bool,
        *,
        what: str,
        max_reply_bytes: int,
        init: dict[str, Any] | None = None,
    ) -> SandboxProcess:
        """`python -m module`, told `init` (the child's own settings) besides the common ones."""
        argv = [sys.executable, "-m", module]
        proc = await asyncio.create_subprocess_exec(
            *(reward_sandbox.command(argv) if sandboxed else argv),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=child_env(),
            start_new_session=True,
            # `unshare` is the worker's child then: it must die with the worker too (its
            # --kill-child takes the namespaces along).
            preexec_fn=_kill_with_worker if sandboxed else None,
        )
        assert proc.stdin is not None
        # The child sees the worker's import path (absolute: its working directory changes),
        # so any function the worker can name, it can import.
        message = {
            **(init or {}),
            "sys_path": [os.path.abspath(entry) for entry in sys.path if isinstance(entry, str)],
            # In the pid namespace the parent is its init, sh, pid 1.
            "parent": 1 if sandboxed else os.getpid(),
            "memory": limits.memory_bytes,
            "file": limits.file_bytes,
            "sandbox": {
                "tmp": limits.tmp_bytes,
                "processes": limits.processes,
                "hide": _identity_paths(),
                # The project and the user's environment stay importable, wherever they are.
                "keep": reward_sandbox.kept_paths(reward_sandbox.import_roots()),
            }
            if sandboxed
            else None,
        }
        proc.stdin.write(frame(message))
        return cls(proc, limits, sandboxed, what, max_reply_bytes)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def request(self, message: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Send one request, return its reply; on any failure kill the process and raise
        ChildLost."""
        cpu_seconds = math.ceil(deadline * self.limits.cpu_factor)
        try:
            async with asyncio.timeout(deadline):
                return await self._roundtrip({**message, "cpu_seconds": cpu_seconds})
        except TimeoutError:
            reason = f"timed out after {deadline:g}s"
        except (asyncio.IncompleteReadError, ConnectionError):
            reason = ""  # the process died: its exit status, known once reaped, says how
        except BadReply as exc:
            reason = f"bad reply from the {self.what}: {exc}"
        except BaseException:  # cancelled (or broken) mid-call: the process is in an unknown state
            await self.kill()
            raise
        await self.kill()
        raise ChildLost(reason or self.death())

    async def request_many(
        self, message: dict[str, Any], count: int, deadline: float
    ) -> tuple[list[dict[str, Any]], str | None]:
        """Send one request that `count` replies answer; each reply must come within `deadline` of
        the one before (one item's deadline, as in `request`). Returns the replies that came and
        None, or, when the process was lost at the next one (and killed), the reason."""
        assert self.proc.stdin is not None
        replies: list[dict[str, Any]] = []
        self.proc.stdin.write(
            frame({**message, "cpu_seconds": math.ceil(deadline * self.limits.cpu_factor)})
        )
        try:
            await self.proc.stdin.drain()
            for _ in range(count):
                async with asyncio.timeout(deadline):
                    replies.append(await self._read_reply())
            return replies, None
        except TimeoutError:
            reason = f"timed out after {deadline:g}s"
        except (asyncio.IncompleteReadError, ConnectionError):
            reason = ""
        except BadReply as exc:
            reason = f"bad reply from the {self.what}: {exc}"
        except BaseException:
            await self.kill()
            raise
        await self.kill()
        return replies, reason or self.death()

    async def _roundtrip(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(frame(message))
        await self.proc.stdin.drain()
        return await self._read_reply()

    async def _read_reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        (size,) = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
        if size > self.max_reply_bytes:
            raise BadReply(f"{size} bytes is over the {self.max_reply_bytes}-byte limit")
        body = await self.proc.stdout.readexactly(size)
        try:
            reply = msgpack.unpackb(body, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad bytes
            raise BadReply(f"not msgpack: {type(exc).__name__}") from None
        if not isinstance(reply, dict):
            raise BadReply(f"a {type(reply).__name__}, not a map")
        return reply

    def death(self) -> str:
        """How the process ended, in one line (its exit status, once reaped)."""
        return _death(self.proc.returncode, self.sandboxed, self.what)

    async def kill(self) -> None:
        """SIGKILL the process and whatever it started (its session), then reap it."""
        if self.proc.returncode is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()


def _identity_paths() -> list[str]:
    """What a sandbox hides of the worker's NATS identity: the directory of its file, or, where
    that directory holds import paths (a seed beside the code), every seed and creds file in it."""
    path = os.environ.get(IDENTITY_ENV)
    if not path:
        return []
    directory = os.path.dirname(os.path.realpath(path))
    imports = [os.path.realpath(entry) for entry in sys.path if isinstance(entry, str)]
    if not any(entry == directory or entry.startswith(directory + os.sep) for entry in imports):
        return [directory]
    with suppress(OSError):
        return [
            os.path.join(directory, name)
            for name in os.listdir(directory)
            if name.endswith((".nk", ".creds"))
        ]
    return []


def _kill_with_worker() -> None:
    """In `unshare` before exec: SIGKILL when the worker dies (kept across exec)."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _death(returncode: int | None, sandboxed: bool, what: str) -> str:
    if sandboxed and returncode is not None and returncode > reward_sandbox.SIGNAL_EXIT:
        returncode = reward_sandbox.SIGNAL_EXIT - returncode  # the init sh's 128 + n
    if returncode is not None and returncode < 0:
        try:
            return f"{what} killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"{what} killed by signal {-returncode}"
    return f"{what} exited with code {returncode}"
