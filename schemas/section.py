"""The base of every config section (`schemas.config`), and the short form of an engine section."""

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: immutable, and an unknown key is an error, not a silent default. The
    docstring under each field is its description (docs/config.md is generated from them)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


def refuse_renamed(data: object, renames: Mapping[str, str]) -> object:
    """For a section's `model_validator(mode="before")`: a key that was renamed is refused in one
    line naming its new name (a user's old YAML would otherwise read "Extra inputs are not
    permitted", or worse, a default silently taken)."""
    if isinstance(data, dict):
        for old, new in renames.items():
            if old in data:
                raise ValueError(f"{old} was renamed to {new}: write {new}: {data[old]!r}")
    return data


def engine_section(value: object) -> object:
    """A bare engine type (`rollout.engine: vllm`, `trainer.engine: fsdp`) as that engine's
    section with its defaults (a field's before-validator; the `type` picks the section)."""
    if isinstance(value, dict) and "type" not in value:
        raise ValueError("an engine section names its engine in `type` (e.g. `type: vllm`)")
    return {"type": value} if isinstance(value, str) else value
