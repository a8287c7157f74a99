"""Which engine copy of a rollout worker generates a prompt: the `Router` Protocol, built-ins.

A rollout worker may run several copies of its engine (`rollout.engine_copies`), each with its
own batcher; for every prompt it asks its router for a copy, given a key and how many prompts
each copy has in flight (queued or generating). The router only picks: the worker counts
in-flight prompts, so a router holds no state it must keep true by itself.

    least_in_flight   the copy with the fewest prompts in flight; ties to the lowest index
    sticky_by_key     a key keeps the copy it was first given (for prefix-cache reuse: one
                      conversation's turns on the engine that holds its prefix); a new key, or
                      none, goes to the least loaded; the table keeps the `max_keys` most
                      recently used keys, so memory stays bounded
    module:Class      any class built as `Class(copies, **options)` with a `pick` method

No bus here (layering): `consumers.rollout` builds the router from the run config.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from schemas.config import RolloutConfig


@runtime_checkable
class Router(Protocol):
    """Picks the engine copy for one prompt."""

    def pick(self, key: str | None, in_flight: Sequence[int]) -> int:
        """The index of the engine copy to use, in ``range(len(in_flight))``.

        key: the prompt's routing key (`consumers.rollout.routing_key`), or None.
        in_flight: per copy, the prompts routed there and not yet generated.
        """
        ...


class RouterError(ValueError):
    """A router that cannot be built; the message is one line."""


def least_loaded(in_flight: Sequence[int]) -> int:
    """The index of the smallest count, the lowest index among equals."""
    return min(range(len(in_flight)), key=in_flight.__getitem__)


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LeastInFlight:
    """The copy with the fewest prompts in flight (ties to the lowest index). No options."""

    class Options(_Options):
        pass

    def __init__(self, copies: int) -> None:
        self.copies = copies

    def pick(self, key: str | None, in_flight: Sequence[int]) -> int:
        return least_loaded(in_flight)


class StickyByKey:
    """A key keeps its copy while it is in the table; new keys (and None) to the least loaded."""

    class Options(_Options):
        max_keys: int = Field(100_000, ge=1)
        """Keys remembered; past it the least recently used is forgotten (its next prompt is
        routed as a new key)."""

    def __init__(self, copies: int, max_keys: int = 100_000) -> None:
        self.copies, self.max_keys = copies, max_keys
        self.table: OrderedDict[str, int] = OrderedDict()
        """key -> copy index, least recently used first."""

    def pick(self, key: str | None, in_flight: Sequence[int]) -> int:
        if key is None:
            return least_loaded(in_flight)
        copy = self.table.get(key)
        if copy is None or copy >= len(in_flight):
            copy = self.table[key] = least_loaded(in_flight)
            if len(self.table) > self.max_keys:
                self.table.popitem(last=False)
        else:
            self.table.move_to_end(key)
        return copy


BUILT_IN: dict[str, type[LeastInFlight | StickyByKey]] = {
    "least_in_flight": LeastInFlight,
    "sticky_by_key": StickyByKey,
}


def router_class(name: str) -> type:
    """The class `name` names (a built-in, or `module:Class` imported);
    RouterError if there is none."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    try:
        RolloutConfig(router=name)
    except ValidationError:
        raise RouterError(
            f"router {name!r}: expected one of {', '.join(BUILT_IN)} or 'module:Class'"
        ) from None
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the config's fault, reported in one line
        raise RouterError(
            f"router {name!r}: cannot import {module_name}: {type(exc).__name__}: {exc}"
        ) from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise RouterError(f"router {name!r}: {module_name} has no class {attr}")
    return cls


def make_router(name: str, copies: int, options: Mapping[str, Any] | None = None) -> Router:
    """The router `name` for `copies` engine copies with `options`; RouterError (one line) if it
    cannot be built.

    A built-in's options are checked against its `Options` model (an unknown name is an error);
    a `module:Class` gets them as keyword arguments, and a class that may not be called so is
    refused the same way.
    """
    cls = router_class(name)
    options = dict(options or {})
    spec = getattr(cls, "Options", None)
    if isinstance(spec, type) and issubclass(spec, BaseModel):
        try:
            options = spec.model_validate(options).model_dump()
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise RouterError(f"router {name!r}: option {where}: {first['msg']}") from None
    try:
        router = cls(copies, **options)
    except TypeError as exc:  # an unknown or missing option of a plugged-in class
        raise RouterError(
            f"router {name!r}: cannot build it with options {sorted(options)}: {exc}"
        ) from None
    if not isinstance(router, Router):
        raise RouterError(
            f"router {name!r}: {cls.__name__} is not a router (no pick(key, in_flight) method)"
        )
    return router
