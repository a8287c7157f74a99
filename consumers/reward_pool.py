"""Run untrusted reward functions in separate processes, each call with a deadline.

A reward function is named `module:function` and called as `function(response_text, task)`;
it returns a number, or a dict with "reward" plus named float components. Whatever it does
instead — hang, raise, `sys.exit`, segfault, allocate without bound, write a huge file,
return NaN or a string — the call ends in a failed `Score` with a one-line reason, and the
pool replaces a process it lost and keeps serving (invariant 4 in docs/architecture.md).

Each pool process is a `consumers.sandbox_process.SandboxProcess` running
`python -m consumers.reward_child`: a scrubbed environment, rlimits, its own session, SIGKILL
when the worker dies and, where the machine allows it (`isolation`, see
consumers/reward_sandbox.py), new user, network, pid and mount namespaces.

Requests and replies are length-prefixed msgpack over the child's stdin/stdout (never
pickle); the child's side, and the protocol, are consumers/reward_child.py.

Why not `pebble` or `multiprocessing`: their spawned processes inherit the parent's
environment with no per-pool override, so the credentials could only be deleted after
start, where `/proc/self/environ` still shows them; and their replies are pickles.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from consumers import reward_sandbox
from consumers.reward_child import RewardSpecError, parse_spec
from consumers.reward_sandbox import Isolation
from consumers.sandbox_process import (
    SCRUBBED_PREFIXES,
    ChildLost,
    Limits,
    SandboxProcess,
    child_env,
    one_line,
)

CHILD_MODULE = "consumers.reward_child"
MAX_REPLY_BYTES = 64 << 10
"""A reply is a float and a few components; a bigger one would not fit a RewardEvent anyway."""

__all__ = [
    "SCRUBBED_PREFIXES",
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
        limits: Limits | None = None,
        isolation: Isolation = "auto",
    ) -> None:
        if processes < 1 or timeout <= 0 or import_timeout <= 0:
            raise ValueError("a reward pool needs processes >= 1 and positive timeouts")
        self.processes = processes
        self.timeout = timeout
        self.import_timeout = import_timeout
        self.limits = limits or Limits()
        self.isolation = isolation
        self.sandboxed = False
        """Whether the processes run in namespaces; decided (and logged) on entering the pool."""
        # A slot is None after its process was lost; the next call to take it starts a new one,
        # so the call that lost it returns at once.
        self._idle: asyncio.Queue[SandboxProcess | None] = asyncio.Queue()
        self._live: set[SandboxProcess] = set()
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
            except ChildLost as exc:
                raise RewardSpecError(str(exc)) from None

    async def score(self, fn: str, response_text: str, task: dict[str, Any]) -> Score:
        """Score one response; never raises for what the function does
        (RewardSpecError for a bad `fn`)."""
        async with self._lease() as child:
            try:
                await self._resolve_in(child, fn)
                request = {"op": "score", "fn": fn, "text": response_text, "task": task}
                reply = await child.request(request, self.timeout)
            except ChildLost as exc:
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
                except ChildLost as exc:  # the import killed it: fail one item, as `score` does
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

    async def _resolve_in(self, child: SandboxProcess, fn: str) -> None:
        """Make `child` import `fn` once; a spec that cannot work is remembered and refused."""
        if fn in self._bad_specs:
            raise RewardSpecError(self._bad_specs[fn])
        if fn in child.resolved:
            return
        try:
            reply = await child.request({"op": "resolve", "fn": fn}, self.import_timeout)
        except ChildLost as exc:
            raise ChildLost(f"importing {fn}: {exc}") from None
        if "error" in reply:
            self._bad_specs[fn] = one_line(str(reply["error"]))
            raise RewardSpecError(self._bad_specs[fn])
        child.resolved.add(fn)

    @asynccontextmanager
    async def _lease(self) -> AsyncIterator[SandboxProcess]:
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

    async def _spawn(self) -> SandboxProcess:
        child = await SandboxProcess.spawn(
            CHILD_MODULE,
            self.limits,
            self.sandboxed,
            what="reward process",
            max_reply_bytes=MAX_REPLY_BYTES,
        )
        self._live.add(child)
        return child


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
