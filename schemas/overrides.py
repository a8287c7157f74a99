"""Hydra-style `key.path=value` overrides over a config file (or the defaults): the one place
every entry point that takes a config (`producers.prompts`, `consumers.fleet`) reads them.

    "trainer.steps=5"   -> parse: key ("trainer", "steps"), value read as YAML (5; `false`,
                           `null`, `[1, 2]`, `/x`, `1e-5` all as a YAML file would read them)
        -> walk the key through the model's fields (sections, dict entries, engine unions):
           an unknown key is refused in one line naming it and the nearest names
        -> merge into the file's parsed YAML -> validate the whole like the file (extra=forbid)

The file is validated alone first (its errors are the file's, `ConfigError`), so an error after
merging is the overrides' (`OverrideError`, which the command lines exit 2 on).

An engine section (`rollout.engine`, `trainer.engine`, a union told apart by `type`) takes
`rollout.engine=vllm` (that engine's defaults), `rollout.engine.type=vllm` (keeping the keys
the new engine shares with the old) and `rollout.engine.slots=8` (a key of the engine the file
or an earlier override names). `type` overrides apply before the others, in whatever order
they are given. Knows nothing of NATS.
"""

from __future__ import annotations

import argparse
import difflib
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import NoneType, UnionType
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from schemas.config import ConfigError, read_yaml, validate
from schemas.section import Section

M = TypeVar("M", bound=Section)
Keys = tuple[str, ...]
SYNTAX = "KEY.PATH=VALUE (e.g. trainer.steps=10, model.path=/models/x, data.sampling.top_p=0.9)"


class OverrideError(ConfigError):
    """An override that cannot be applied: bad syntax, an unknown key, or a value the config
    refuses. One line naming the override."""


@dataclass(frozen=True)
class Override:
    text: str
    """As given on the command line."""
    key: tuple[str, ...]
    value: object


def parse_override(text: str) -> Override:
    """`a.b=c` as its key and its value read as YAML; an OverrideError for anything else."""
    key, sep, raw = text.partition("=")
    parts = tuple(key.strip().split("."))
    if not sep or not all(parts):
        raise OverrideError(f"override {text!r}: expected {SYNTAX}")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise OverrideError(
            f"override {text!r}: not a YAML value: {' '.join(str(exc).split())}"
        ) from None
    return Override(text, parts, value)


class _Unknown(Exception):
    def __init__(self, where: Keys, name: str, names: list[str], label: str) -> None:
        self.where, self.name, self.names, self.label = where, name, names, label


class _NotASection(Exception):
    def __init__(self, where: tuple[str, ...], why: str) -> None:
        self.where, self.why = where, why


def merge(model: type[BaseModel], data: object, override: Override) -> dict[str, Any]:
    """`data` (a parsed config, not changed) with `override` set; an OverrideError naming the
    key if `model` has no such key."""
    try:
        return _into_model(model, data, override.key, override.value, ())
    except _Unknown as unknown:
        raise OverrideError(f"override {override.text!r}: {_unknown(model, unknown)}") from None
    except _NotASection as bad:
        raise OverrideError(
            f"override {override.text!r}: {'.'.join(bad.where)} {bad.why}"
        ) from None


def apply_overrides(model: type[M], data: object, texts: Sequence[str], origin: str) -> M:
    """`data` (parsed YAML, valid as `model` on its own) with the overrides `texts`, validated."""
    overrides = [parse_override(text) for text in texts]
    # An engine's `type` first: the keys given for the engine then land in its section.
    merged: object = data
    for override in sorted(overrides, key=lambda o: not _picks_engine(model, o.key)):
        merged = merge(model, merged, override)
    try:
        return validate(model, merged, "override")
    except ConfigError as exc:
        message = str(exc).removeprefix("override: ")
        key = message.split(":", 1)[0]
        blamed = [o.text for o in overrides if _overlaps(o.key, tuple(key.split(".")))]
        given = " ".join(blamed or texts)
        raise OverrideError(f"{origin} with {given}: {message}") from None


def load_with_overrides(
    model: type[M], path: Path | None, texts: Sequence[str], defaults: object = None
) -> M:
    """The config at `path` (else `defaults`) validated alone (a ConfigError is the file's), then
    with the overrides (an OverrideError is theirs)."""
    data = read_yaml(path) if path is not None else defaults
    origin = str(path) if path is not None else "the defaults"
    config = validate(model, data, origin)
    return apply_overrides(model, data, texts, origin) if texts else config


def _picks_engine(model: type[BaseModel], key: Keys) -> bool:
    """Whether `key` names an engine section (`rollout.engine`) or its `type`."""
    current: type[BaseModel] | None = model
    for index, name in enumerate(key):
        field = current.model_fields.get(name) if current is not None else None
        if field is None:
            return False
        if isinstance(field.discriminator, str):
            return key[index + 1 :] in ((), (field.discriminator,))
        current = _section(field.annotation)
    return False


def _overlaps(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    shorter = min(len(a), len(b))
    return a[:shorter] == b[:shorter]


# The walk -----------------------------------------------------------------------------------


def _into_model(
    model: type[BaseModel],
    node: object,
    path: Keys,
    value: object,
    where: Keys,
    label: str = "",
) -> dict[str, Any]:
    out = dict(node) if isinstance(node, dict) else {}
    name, rest = path[0], path[1:]
    field = model.model_fields.get(name)
    if field is None:
        raise _Unknown(where, name, list(model.model_fields), label or ".".join(where))
    out[name] = _into_field(field.annotation, field, out.get(name), rest, value, (*where, name))
    return out


def _into_field(
    annotation: Any, field: FieldInfo | None, node: object, path: Keys, value: object, where: Keys
) -> object:
    if not path:
        return value
    if field is not None and isinstance(field.discriminator, str):
        return _into_union(field, field.discriminator, node, path, value, where)
    section = _section(annotation)
    if section is not None:
        return _into_model(section, node, path, value, where)
    if get_origin(annotation) is dict or annotation is Any:
        out = dict(node) if isinstance(node, dict) else {}
        entry = get_args(annotation)[1] if get_origin(annotation) is dict else Any
        out[path[0]] = _into_field(
            entry, None, out.get(path[0]), path[1:], value, (*where, path[0])
        )
        return out
    raise _NotASection(where, f"is a value, not a section: it has no key {path[0]!r}")


def _into_union(
    field: FieldInfo, tag: str, node: object, path: Keys, value: object, where: Keys
) -> dict[str, Any]:
    """An engine section: `node` as the file gives it (a dict with `type`, a bare type, absent:
    the default engine), with `path` set in the section of its type."""
    members = {m.model_fields[tag].default: m for m in _members(field.annotation)}
    if isinstance(node, dict):
        out = dict(node)
    else:
        out = {tag: node if isinstance(node, str) else getattr(field.default, tag)}
    if path == (tag,):
        if value not in members:
            types = ", ".join(map(str, members))
            raise _NotASection((*where, tag), f"{value!r} is not one of {types}")
        if value != out.get(tag):  # another engine: keep what it shares with the old
            out = {k: v for k, v in out.items() if k in members[value].model_fields}
        return {**out, tag: value}
    member = members.get(out.get(tag))
    if member is None:
        raise _NotASection((*where, tag), f"{out.get(tag)!r} is not one of {', '.join(members)}")
    label = f"{'.'.join(where)} of type {out[tag]}"
    return _into_model(member, out, path, value, where, label)


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section class of a field typed `Section` or `Section | None`, else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, UnionType):
        models = [a for a in get_args(annotation) if a is not NoneType]
        if len(models) == 1:
            return _section(models[0])
    return None


def _members(annotation: Any) -> list[type[BaseModel]]:
    if get_origin(annotation) in (Union, UnionType):
        return [a for a in get_args(annotation) if isinstance(a, type)]
    return [annotation]


# The message of an unknown key ------------------------------------------------------------


def _unknown(model: type[BaseModel], unknown: _Unknown) -> str:
    """`unknown key trainer.lr; nearest in trainer: ...; algorithm.lr has that name`."""
    key = ".".join((*unknown.where, unknown.name))
    section = unknown.label or "the top level"
    near = difflib.get_close_matches(unknown.name, unknown.names, n=3, cutoff=0.6)
    if near:
        names = f"nearest in {section}: {', '.join(near)}"
    else:
        names = f"{section} has {', '.join(unknown.names)}"
    elsewhere = [p for p in _paths(model, ()) if p.split(" ")[0].endswith(f".{unknown.name}")]
    # The shallowest first: `algorithm.lr` is more likely meant than `model.warm_start.lr`.
    elsewhere.sort(key=lambda p: p.split(" ")[0].count("."))
    found = f"; that name is at {', '.join(elsewhere[:4])}" if elsewhere else ""
    return f"unknown key {key} ({names}){found}"


def _paths(model: type[BaseModel], where: Keys) -> Iterator[str]:
    """Every key of `model` and its sections, engine members' keys included, dotted."""
    for name, field in model.model_fields.items():
        yield ".".join((*where, name))
        tag = field.discriminator if isinstance(field.discriminator, str) else None
        inner = (
            _members(field.annotation)
            if tag
            else [s for s in [_section(field.annotation)] if s is not None]
        )
        for section in inner:
            for path in _paths(section, (*where, name)):
                yield f"{path} (type {section.model_fields[tag].default})" if tag else path


def add_overrides_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """The positional `KEY.PATH=VALUE` arguments every entry point with a config takes."""
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY.PATH=VALUE",
        help=f"set one {what} key over the file (see below and docs/config.md)",
    )


def help_epilog(prog: str, example: str) -> str:
    """The `--help` text on overrides and where every key is documented (for an argparse
    RawDescriptionHelpFormatter: wrapped here)."""
    about = (
        "overrides: KEY.PATH=VALUE arguments set one key of the config over the --config file "
        "(or the defaults); VALUE is read as YAML (10, 1e-5, false, null, [1, 2], /a/path) and "
        "checked like the file. An engine section takes its type (rollout.engine=vllm) or its "
        "keys (rollout.engine.type=simulated rollout.engine.slots=8)."
    )
    docs = (
        "Every key, its type, default and meaning: docs/config.md. --dry-run prints the "
        "resolved config and what it derives, and starts nothing."
    )
    return f"{textwrap.fill(about, 78)}\n\n  {prog} {example}\n\n{textwrap.fill(docs, 78)}\n"
