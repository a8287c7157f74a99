"""The reward process itself: `python -m consumers.reward_child`,
started by consumers/reward_pool.py.

It reads one init message, makes itself what the pool asked for (the worker's import path,
SIGKILL when the worker dies, the sandbox where one was chosen, rlimits), then serves
requests until the worker closes the pipe:

    worker (RewardPool) --init, then {"op": resolve|score|score_batch, ...}--> stdin
    worker (RewardPool) <-- one reply per request (per item of a batch) -- stdout

Requests and replies are length-prefixed msgpack (`HEADER` + body), never pickle: the parent
must not run code on the child's say-so. The child moves the protocol to private descriptors
first, so a function that prints cannot corrupt it. This module imports only what the child
needs; the parent side imports its protocol pieces (`HEADER`, `frame`, `parse_spec`) from here.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import numbers
import os
import resource
import signal
import struct
import sys
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import msgpack

from consumers import reward_sandbox

HEADER = struct.Struct(">I")
"""The length prefix of every framed message, both ways."""
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

RewardFn = Callable[[str, dict[str, Any]], object]


class RewardSpecError(ValueError):
    """A `module:function` that cannot be used; the message is one line."""


def parse_spec(spec: str) -> tuple[str, str]:
    """`"module:function"` -> (module, function)."""
    module, colon, name = spec.partition(":")
    if not (module and colon and name):
        raise RewardSpecError(f"reward function {spec!r} must be 'module:function'")
    return module, name


def frame(message: object) -> bytes:
    """`message` as msgpack behind its length prefix."""
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


class _BadReturn(Exception):
    """A reward function's return value that is not a reward."""


def _child_main() -> None:
    """Serve requests until the worker closes the pipe (or kills this process)."""
    requests, replies = _claim_protocol_fds()
    init = _receive(requests)
    if init is None:
        return
    sys.path[:] = init["sys_path"]
    _die_with_parent(init["parent"])
    if init["sandbox"] is not None:
        sys.dont_write_bytecode = True  # the tree is read-only now
        try:
            reward_sandbox.enter(
                init["sandbox"]["tmp"], init["sandbox"]["processes"], init["sandbox"]["hide"]
            )
        except OSError as exc:  # a sandbox half made is no sandbox: the pool reports the exit
            print(f"reward sandbox: {exc}", file=sys.stderr)
            os._exit(70)
    _set_limit(resource.RLIMIT_AS, init["memory"])
    _set_limit(resource.RLIMIT_FSIZE, init["file"])
    _set_limit(resource.RLIMIT_CORE, 0)  # a crashing function must not fill the disk with cores
    functions: dict[str, RewardFn] = {}
    server = os.getpid()
    while (request := _receive(requests)) is not None:
        # A batch is answered item by item, each under its own CPU limit, so the parent knows
        # which item a hang or crash belongs to.
        for one in _items(request):
            _renew_cpu_limit(request["cpu_seconds"])
            reply = _serve(one, functions)
            if (
                os.getpid() != server
            ):  # a copy the function forked, back from the call: it must not reply
                os._exit(0)
            replies.write(frame(reply))
            replies.flush()


def _items(request: dict[str, Any]) -> list[dict[str, Any]]:
    """A "score_batch" request as one "score" request per item; any other request as itself."""
    if request["op"] != "score_batch":
        return [request]
    return [
        {"op": "score", "fn": request["fn"], "text": text, "task": task}
        for text, task in request["items"]
    ]


def _claim_protocol_fds() -> tuple[BinaryIO, BinaryIO]:
    """Keep stdin/stdout for the protocol on private descriptors; fd 0 becomes /dev/null,
    fd 1 stderr."""
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return requests, replies


def _receive(stream: BinaryIO) -> Any:
    """The next framed message, or None when the worker has closed the pipe."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    return msgpack.unpackb(stream.read(size), raw=False)


def _die_with_parent(parent: int) -> None:
    """Ask Linux for SIGKILL when the worker dies: a hung call must not outlive it."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the worker died before the request above took effect
        os._exit(0)


def _set_limit(kind: int, soft: int, keep_hard: bool = False) -> None:
    """Set a soft limit, never above the inherited hard one, and lower the hard one to it
    unless `keep_hard` (so the function cannot raise the limit again)."""
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(kind, (soft, hard if keep_hard else soft))


def _renew_cpu_limit(seconds: int) -> None:
    """Allow `seconds` more CPU time: RLIMIT_CPU counts the process's whole life, not one call."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    # The hard limit stays where it was: a lowered one could not be raised for the next call.
    _set_limit(
        resource.RLIMIT_CPU, math.ceil(usage.ru_utime + usage.ru_stime) + seconds, keep_hard=True
    )


def _serve(request: dict[str, Any], functions: dict[str, RewardFn]) -> dict[str, Any]:
    """Run one request ("resolve": import a function; "score": call it) and make its reply."""
    fn = request["fn"]
    if request["op"] == "resolve":
        try:
            functions[fn] = _load(fn)
        except RewardSpecError as exc:
            return {"error": str(exc)}
        return {}
    try:
        value = functions[fn](request["text"], request["task"])
    except SystemExit as exc:
        return {"error": f"called sys.exit({exc.code!r})"}
    except BaseException as exc:  # the function's failure is the call's result, whatever it is
        return {"error": f"raised {_describe(exc)}"}
    try:
        reward, components = _interpret(value)
    except _BadReturn as exc:
        return {"error": str(exc)}
    return {"reward": reward, "components": components}


def _load(spec: str) -> RewardFn:
    module_name, name = parse_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except (
        BaseException
    ) as exc:  # an import runs arbitrary code: any failure means the spec is unusable
        raise RewardSpecError(
            f"reward function {spec!r}: cannot import {module_name!r}: {_describe(exc)}"
        ) from None
    fn = getattr(module, name, None)
    if fn is None:
        raise RewardSpecError(
            f"reward function {spec!r}: module {module_name!r} has no attribute {name!r}"
        )
    if not callable(fn):
        raise RewardSpecError(
            f"reward function {spec!r}: {name!r} is not callable (it is {type(fn).__name__})"
        )
    return fn


def _interpret(value: object) -> tuple[float, dict[str, float]]:
    """A number, or a dict with "reward" and named numbers -> (reward, components)."""
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise _BadReturn(
                f"returned a dict without 'reward' (keys: {sorted(map(str, value))[:10]})"
            )
        components = {
            str(key): _as_float(part, f"component {key!r}")
            for key, part in value.items()
            if key != "reward"
        }
        return _as_float(value["reward"], "reward"), components
    return _as_float(value, "reward"), {}


def _as_float(value: object, what: str) -> float:
    # numbers.Real covers int, float, bool and numpy scalars; str, None, lists are not rewards.
    if not isinstance(value, numbers.Real):
        raise _BadReturn(f"returned a {type(value).__name__} as {what}, expected a number")
    return float(value)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


if __name__ == "__main__":
    _child_main()
