"""The base of every config section (`schemas.config`)."""

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: immutable, and an unknown key is an error, not a silent default."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def refuse_renamed(data: object, renames: Mapping[str, str]) -> object:
    """For a section's `model_validator(mode="before")`: a key that was renamed is refused in one
    line naming its new name (a user's old YAML would otherwise read "Extra inputs are not
    permitted", or worse, a default silently taken)."""
    if isinstance(data, dict):
        for old, new in renames.items():
            if old in data:
                raise ValueError(f"{old} was renamed to {new}: write {new}: {data[old]!r}")
    return data
