"""The reward process itself: `python -m consumers.reward_child`,
started by consumers/reward_pool.py.

It makes itself what the pool asked for (`consumers.sandbox_child.begin`: the import path,
SIGKILL when the worker dies, the sandbox where one was chosen, rlimits), then serves
requests until the worker closes the pipe:

    worker (RewardPool) --init, then {"op": resolve|score|score_batch, ...}--> stdin
    worker (RewardPool) <-- one reply per request (per item of a batch) -- stdout

Requests and replies are length-prefixed msgpack (`HEADER` + body), never pickle: the parent
must not run code on the child's say-so. The child moves the protocol to private descriptors
first, so a function that prints cannot corrupt it. This module imports only what the child
needs; the pool imports `parse_spec` and `RewardSpecError` from here.
"""

from __future__ import annotations

import importlib
import numbers
import os
from collections.abc import Callable, Mapping
from typing import Any

from consumers.sandbox_child import (
    HEADER,
    PR_SET_PDEATHSIG,
    begin,
    describe,
    frame,
    receive,
    renew_cpu_limit,
)

__all__ = ["HEADER", "PR_SET_PDEATHSIG", "RewardSpecError", "frame", "parse_spec"]

RewardFn = Callable[[str, dict[str, Any]], object]


class RewardSpecError(ValueError):
    """A `module:function` that cannot be used; the message is one line."""


def parse_spec(spec: str) -> tuple[str, str]:
    """`"module:function"` -> (module, function)."""
    module, colon, name = spec.partition(":")
    if not (module and colon and name):
        raise RewardSpecError(f"reward function {spec!r} must be 'module:function'")
    return module, name


class _BadReturn(Exception):
    """A reward function's return value that is not a reward."""


def _child_main() -> None:
    """Serve requests until the worker closes the pipe (or kills this process)."""
    started = begin()
    if started is None:
        return
    requests, replies, _ = started
    functions: dict[str, RewardFn] = {}
    server = os.getpid()
    while (request := receive(requests)) is not None:
        # A batch is answered item by item, each under its own CPU limit, so the parent knows
        # which item a hang or crash belongs to.
        for one in _items(request):
            renew_cpu_limit(request["cpu_seconds"])
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
        return {"error": f"raised {describe(exc)}"}
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
            f"reward function {spec!r}: cannot import {module_name!r}: {describe(exc)}"
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


if __name__ == "__main__":
    _child_main()
