"""`python -m ops.config_doc > docs/config.md`: the configuration reference, generated from the
pydantic models, so that it cannot drift from what is validated.

    RunConfig (schemas.config), FleetConfig (consumers.fleet_config)
        -> per section, depth first: its class docstring, then one table row per field: the key,
           its type and bounds, its default, its description (the docstring under the field,
           `use_attribute_docstrings` in `schemas.section.Section`)
        -> an engine union (`rollout.engine`, `trainer.engine`): one table per engine type;
           a dict of sections (`roles`): one table for `roles.<name>`

tests/test_config_doc.py fails when docs/config.md differs from this output, and when a field
has no description. Here in ops/ because it reads the fleet's model (consumers/) too.
"""

from __future__ import annotations

import enum
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from consumers.fleet_config import FleetConfig
from schemas.config import RunConfig

OR = " \\| "
"""A table cell's \"or\" (a bare pipe would end the cell)."""
DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"

HEADER = """# Configuration reference

Generated from the pydantic models by `python -m ops.config_doc > docs/config.md`; do not edit
by hand (tests/test_config_doc.py fails when this file is out of date). Every section refuses an
unknown key (`extra=forbid`): a typo is an error at load, in one line naming the key.

Every key is set in the YAML given to `--config`, or on the command line after it as a
`KEY.PATH=VALUE` override (its value read as YAML, checked like the file):

    python -m producers.prompts --config examples/digits.yaml trainer.steps=20 algorithm.lr=1e-5 \\
        rollout.engine=simulated rollout.engine.slots=8 --dry-run
    python -m consumers.fleet --config examples/fleet.yaml roles.rollout.processes=4 --dry-run

`--dry-run` prints the resolved config (and, for the producer, the stream limits it derives)
and starts nothing. An engine section (`rollout.engine`, `trainer.engine`) is picked by its
`type`: the bare type (`rollout.engine: vllm`, `rollout.engine=vllm`) takes that engine's
defaults; a `type` override keeps the keys the new engine shares with the old.
"""

PARTS = (
    (
        RunConfig,
        "The run config",
        "`python -m producers.prompts --config`; the producer stores it in the run's KV bucket "
        "and every worker of the run reads it from there.",
    ),
    (
        FleetConfig,
        "The fleet config",
        "`python -m consumers.fleet --config` (and `python -m ops.ray`): one node's workers.",
    ),
)


def render() -> str:
    lines = [HEADER]
    for model, title, about in PARTS:
        lines += [f"## {title}", "", about, ""]
        lines += _section(model, (), None, title.removeprefix("The ").capitalize())
    return "\n".join(lines).rstrip() + "\n"


def undocumented() -> list[str]:
    """Every key with no description (the docstring under the field)."""
    return [key for model, _, _ in PARTS for key in _missing(model, ())]


def _missing(model: type[BaseModel], where: tuple[str, ...]) -> Iterator[str]:
    for name, field in model.model_fields.items():
        if not field.description:
            yield ".".join((*where, name))
        for key, inner, _ in _inner(name, field, where):
            yield from _missing(inner, key)


def _section(
    model: type[BaseModel], where: tuple[str, ...], tag: str | None, part: str
) -> list[str]:
    """The heading, docstring and table of one section, then its sections'."""
    title = f"{part}: `{'.'.join(where)}`" if where else f"{part}: top level"
    lines = [f"### {title}{f' with `type: {tag}`' if tag else ''}", ""]
    own = model.__dict__.get("__doc__")
    if own:
        lines += [_one_line(own), ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    nested: list[str] = []
    for name, field in model.model_fields.items():
        row = [f"`{name}`", _type(field), _default(field), _one_line(field.description or "")]
        lines.append("| " + " | ".join(row) + " |")
        for key, inner, inner_tag in _inner(name, field, where):
            nested += _section(inner, key, inner_tag, part)
    return [*lines, "", *nested]


def _inner(
    name: str, field: FieldInfo, where: tuple[str, ...]
) -> Iterator[tuple[tuple[str, ...], type[BaseModel], str | None]]:
    """The sections a field holds: its section, each engine of its union, or the section of each
    entry of a dict (`roles.<name>`)."""
    annotation = field.annotation
    if isinstance(field.discriminator, str):
        for member in get_args(annotation):
            yield (*where, name), member, member.model_fields[field.discriminator].default
        return
    if get_origin(annotation) is dict:
        value = get_args(annotation)[1]
        if isinstance(value, type) and issubclass(value, BaseModel):
            yield (*where, name, "<name>"), value, None
        return
    section = _model_of(annotation)
    if section is not None:
        yield (*where, name), section, None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        models = [_model_of(a) for a in get_args(annotation) if a is not types.NoneType]
        return models[0] if len(models) == 1 else None
    return None


def _type(field: FieldInfo) -> str:
    if isinstance(field.discriminator, str):
        tags = [m.model_fields[field.discriminator].default for m in get_args(field.annotation)]
        text = f"engine section: {OR.join(f'`{t}`' for t in tags)} (or the bare type)"
    elif _model_of(field.annotation) is not None:
        text = "section (below)"
    else:
        text = _name(field.annotation)
    bounds = [b for b in map(_bound, field.metadata) if b]
    return f"{text} ({', '.join(bounds)})" if bounds else text


def _name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is types.NoneType or annotation is None:
        return "null"
    if annotation is Any:
        return "any"
    if origin is Literal:
        return OR.join(f"`{json.dumps(a)}`" for a in args)
    if origin in (Union, types.UnionType):
        return OR.join(_name(a) for a in args)
    if origin is Annotated:
        return _name(args[0])
    if origin in (dict, list, tuple):
        inner = ", ".join("..." if a is Ellipsis else _name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _bound(item: object) -> str:
    for kind, attribute, sign in (
        (annotated_types.Ge, "ge", ">="),
        (annotated_types.Gt, "gt", ">"),
        (annotated_types.Le, "le", "<="),
        (annotated_types.Lt, "lt", "<"),
    ):
        if isinstance(item, kind):
            return f"{sign} {getattr(item, attribute)}"
    if isinstance(item, annotated_types.MinLen):
        return f"at least {item.min_length} entry"
    pattern = getattr(item, "pattern", None)
    return f"matching `{pattern}`" if pattern else ""


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
    if isinstance(field.discriminator, str):
        return f"`{getattr(value, field.discriminator)}`"
    if isinstance(value, BaseModel):
        return "(its defaults)"
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{json.dumps(value, default=str)}`"


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
