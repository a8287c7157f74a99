"""The base of every config section (`schemas.config`)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: immutable, and an unknown key is an error, not a silent default."""

    model_config = ConfigDict(frozen=True, extra="forbid")
