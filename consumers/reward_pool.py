"""Run untrusted reward functions in separate processes, each call with a deadline.

A reward function is named `module:function` and called as `function(response_text, task)`;
it returns a number, or a dict with "reward" plus named float components. Whatever it does
instead — hang, raise, `sys.exit`, segfault, allocate without bound, write a huge file,
return NaN or a string — the call ends in a failed `Score` with a one-line reason, and the
pool replaces a process it lost and keeps serving (invariant 4 in docs/architecture.md).

Each pool process is a fresh interpreter (`python -m consumers.reward_child`) started with:
- an environment without the worker's NATS_/JETRL_/OTEL_ variables: they are left out when
  the process is exec'ed, so they are not in `/proc/self/environ` either; and none of the
  worker's open descriptors (its NATS socket);
- limits on address space (MemoryError), file size (the write fails with EFBIG) and core
  size, and a CPU-time limit renewed before each request (SIGXCPU past it);
- its own session, and (Linux) SIGKILL when the worker dies, so a hung call never outlives
  the worker and a kill of the whole group takes anything the function started along;
- where the machine allows it (`isolation`, see consumers/reward_sandbox.py), new user,
  network, pid and mount namespaces: no network, no other process's /proc, a private /tmp
  and the rest of the filesystem read-only, and a bound on the processes it may fork.

Requests and replies are length-prefixed msgpack over the child's stdin/stdout (never
pickle); the child's side, and the protocol, are consumers/reward_child.py.

Why not `pebble` or `multiprocessing`: their spawned processes inherit the parent's
environment with no per-pool override, so the credentials could only be deleted after
start, where `/proc/self/environ` still shows them; and their replies are pickles.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import msgpack

from bus.identity import IDENTITY_ENV
from consumers import reward_sandbox
from consumers.reward_child import HEADER, PR_SET_PDEATHSIG, RewardSpecError, frame, parse_spec
from consumers.reward_sandbox import Isolation

SCRUBBED_PREFIXES = ("NATS_", "JETRL_", "OTEL_")
"""Environment variables a reward process must not see (connection URLs, credentials)."""
CHILD_MODULE = "consumers.reward_child"
MAX_REPLY_BYTES = 64 << 10
"""A reply is a float and a few components; a bigger one would not fit a RewardEvent anyway."""
MAX_REASON_CHARS = 500

__all__ = [
    "Limits",
    "RewardPool",
    "RewardSpecError",
    "Score",
    "child_env",
    "one_line",
    "parse_spec",
]


@dataclass(frozen=True)
class Score:
    """What one reward call produced; a failed call scores 0.0 and says why."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    failed: bool = False
    reason: str = ""

    @classmethod
    def failure(cls, reason: str) -> Score:
        return cls(0.0, {}, True, one_line(reason))


@dataclass(frozen=True)
class Limits:
    """Resource limits of every pool process."""

    memory_bytes: int = 2 << 30
    """Address space (RLIMIT_AS); past it allocations raise MemoryError."""
    file_bytes: int = 16 << 20
    """Largest file the process may write (RLIMIT_FSIZE)."""
    cpu_factor: float = 3.0
    """CPU seconds one request may use, as a multiple of its deadline (RLIMIT_CPU)."""
    processes: int = 64
    """Processes a sandboxed reward process may have at once, itself included (RLIMIT_NPROC,
    counted in its own user namespace; without isolation it is not set)."""
    tmp_bytes: int = 64 << 20
    """Size of a sandboxed process's private /tmp (and /dev/shm), its only writable directory."""


def one_line(text: str) -> str:
    """`text` on one line, cut to MAX_REASON_CHARS (reasons travel in events and headers)."""
    return " ".join(text.split())[:MAX_REASON_CHARS]


def child_env() -> dict[str, str]:
    """The worker's environment without the variables a reward process must not see."""
    return {
        key: value for key, value in os.environ.items() if not key.startswith(SCRUBBED_PREFIXES)
    }


class RewardPool:
    """`processes` reward processes; `score` runs one call on a free one within `timeout` s.

    A process's first use of a function imports it under `import_timeout` instead, so a
    slow import does not eat into the first call's deadline. Use as
    `async with RewardPool(...) as pool:` inside the event loop that calls it.
    """

    def __init__(
        self,
        processes: int = 2,
        timeout: float = 5.0,
        *,
        import_timeout: float = 60.0,
        limits: Limits = Limits(),
        isolation: Isolation = "auto",
    ) -> None:
        if processes < 1 or timeout <= 0 or import_timeout <= 0:
            raise ValueError("a reward pool needs processes >= 1 and positive timeouts")
        self.processes = processes
        self.timeout = timeout
        self.import_timeout = import_timeout
        self.limits = limits
        self.isolation = isolation
        self.sandboxed = False
        """Whether the processes run in namespaces; decided (and logged) on entering the pool."""
        # A slot is None after its process was lost; the next call to take it starts a new one,
        # so the call that lost it returns at once.
        self._idle: asyncio.Queue[_Child | None] = asyncio.Queue()
        self._live: set[_Child] = set()
        self._bad_specs: dict[str, str] = {}

    async def __aenter__(self) -> RewardPool:
        self.sandboxed = await reward_sandbox.choose(self.isolation)
        for child in await asyncio.gather(*(self._spawn() for _ in range(self.processes))):
            self._idle.put_nowait(child)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Kill every pool process (they hold no state)."""
        await asyncio.gather(*(child.kill() for child in list(self._live)))
        self._live.clear()

    async def resolve(self, fn: str) -> None:
        """Import `fn` in a pool process now; raise RewardSpecError if it cannot be used."""
        async with self._lease() as child:
            try:
                await self._resolve_in(child, fn)
            except _ChildLost as exc:
                raise RewardSpecError(str(exc)) from None

    async def score(self, fn: str, response_text: str, task: dict[str, Any]) -> Score:
        """Score one response; never raises for what the function does
        (RewardSpecError for a bad `fn`)."""
        async with self._lease() as child:
            try:
                await self._resolve_in(child, fn)
                request = {"op": "score", "fn": fn, "text": response_text, "task": task}
                reply = await child.request(request, self.timeout)
            except _ChildLost as exc:
                return Score.failure(str(exc))
        return _score_from(reply)

    async def score_many(self, fn: str, items: list[tuple[str, dict[str, Any]]]) -> list[Score]:
        """Score `items` (response_text, task) in one round trip to one process, each item under
        its own `timeout` as if scored alone. The process answers item by item, so when one item
        hangs or kills its process, the items before it keep their scores, that item fails with
        the reason, and the items after it are scored again on a fresh lease."""
        scores: list[Score] = []
        while len(scores) < len(items):
            rest = items[len(scores) :]
            async with self._lease() as child:
                try:
                    await self._resolve_in(child, fn)
                except _ChildLost as exc:  # the import killed it: fail one item, as `score` does
                    scores.append(Score.failure(str(exc)))
                    continue
                request = {
                    "op": "score_batch",
                    "fn": fn,
                    "items": [[text, task] for text, task in rest],
                }
                replies, lost = await child.request_many(request, len(rest), self.timeout)
                scores.extend(_score_from(reply) for reply in replies)
                if lost is not None:
                    scores.append(Score.failure(lost))
        return scores

    async def _resolve_in(self, child: _Child, fn: str) -> None:
        """Make `child` import `fn` once; a spec that cannot work is remembered and refused."""
        if fn in self._bad_specs:
            raise RewardSpecError(self._bad_specs[fn])
        if fn in child.resolved:
            return
        try:
            reply = await child.request({"op": "resolve", "fn": fn}, self.import_timeout)
        except _ChildLost as exc:
            raise _ChildLost(f"importing {fn}: {exc}") from None
        if "error" in reply:
            self._bad_specs[fn] = one_line(str(reply["error"]))
            raise RewardSpecError(self._bad_specs[fn])
        child.resolved.add(fn)

    @asynccontextmanager
    async def _lease(self) -> AsyncIterator[_Child]:
        """Take a free process (starting one where the slot's was lost) and give it back after."""
        child = await self._idle.get()
        try:
            if child is None:
                child = await self._spawn()
            yield child
        finally:
            self._idle.put_nowait(child if child is not None and child.alive else None)
            if child is not None and not child.alive:
                self._live.discard(child)

    async def _spawn(self) -> _Child:
        child = await _Child.spawn(self.limits, self.sandboxed)
        self._live.add(child)
        return child


class _ChildLost(Exception):
    """A request that ended with its process killed or dead; the message is the reason."""


class _BadReply(Exception):
    """A reply that breaks the protocol; the process can no longer be trusted to frame one."""


class _Child:
    """One reward process (parent side) and the functions it has imported."""

    def __init__(self, proc: asyncio.subprocess.Process, limits: Limits, sandboxed: bool) -> None:
        self.proc = proc
        self.limits = limits
        self.sandboxed = sandboxed
        self.resolved: set[str] = set()

    @classmethod
    async def spawn(cls, limits: Limits, sandboxed: bool) -> _Child:
        argv = [sys.executable, "-m", CHILD_MODULE]
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
        init = {
            "sys_path": [os.path.abspath(entry) for entry in sys.path if isinstance(entry, str)],
            # In the pid namespace the parent is its init, sh, pid 1.
            "parent": 1 if sandboxed else os.getpid(),
            "memory": limits.memory_bytes,
            "file": limits.file_bytes,
            "sandbox": {
                "tmp": limits.tmp_bytes,
                "processes": limits.processes,
                "hide": _identity_paths(),
            }
            if sandboxed
            else None,
        }
        proc.stdin.write(frame(init))
        return cls(proc, limits, sandboxed)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def request(self, message: dict[str, Any], deadline: float) -> dict[str, Any]:
        """Send one request, return its reply; on any failure kill the process and raise
        _ChildLost."""
        cpu_seconds = math.ceil(deadline * self.limits.cpu_factor)
        try:
            async with asyncio.timeout(deadline):
                return await self._roundtrip({**message, "cpu_seconds": cpu_seconds})
        except TimeoutError:
            reason = f"timed out after {deadline:g}s"
        except (asyncio.IncompleteReadError, ConnectionError):
            reason = ""  # the process died: its exit status, known once reaped, says how
        except _BadReply as exc:
            reason = f"bad reply from the reward process: {exc}"
        except BaseException:  # cancelled (or broken) mid-call: the process is in an unknown state
            await self.kill()
            raise
        await self.kill()
        raise _ChildLost(reason or _death(self.proc.returncode, self.sandboxed))

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
        except _BadReply as exc:
            reason = f"bad reply from the reward process: {exc}"
        except BaseException:
            await self.kill()
            raise
        await self.kill()
        return replies, reason or _death(self.proc.returncode)

    async def _roundtrip(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(frame(message))
        await self.proc.stdin.drain()
        return await self._read_reply()

    async def _read_reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        (size,) = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
        if size > MAX_REPLY_BYTES:
            raise _BadReply(f"{size} bytes is over the {MAX_REPLY_BYTES}-byte limit")
        body = await self.proc.stdout.readexactly(size)
        try:
            reply = msgpack.unpackb(body, raw=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad bytes
            raise _BadReply(f"not msgpack: {type(exc).__name__}") from None
        if not isinstance(reply, dict):
            raise _BadReply(f"a {type(reply).__name__}, not a map")
        return reply

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


def _death(returncode: int | None, sandboxed: bool = False) -> str:
    if sandboxed and returncode is not None and returncode > reward_sandbox.SIGNAL_EXIT:
        returncode = reward_sandbox.SIGNAL_EXIT - returncode  # the init sh's 128 + n
    if returncode is not None and returncode < 0:
        try:
            return f"reward process killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"reward process killed by signal {-returncode}"
    return f"reward process exited with code {returncode}"


def _score_from(reply: dict[str, Any]) -> Score:
    """Check a child's reply (it may have been forged by the function) and make it a Score."""
    if "error" in reply:
        return Score.failure(str(reply["error"]))
    reward, components = reply.get("reward"), reply.get("components")
    if not (isinstance(reward, float) and isinstance(components, dict)) or not all(
        isinstance(name, str) and isinstance(value, float) for name, value in components.items()
    ):
        return Score.failure("malformed reply from the reward process")
    for name, value in {"reward": reward, **components}.items():
        if not math.isfinite(value):
            return Score.failure(f"returned a non-finite {name}: {value}")
    return Score(reward, components)
