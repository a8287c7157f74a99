"""The base of every config section (`schemas.config`), and the short form of an engine section."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: immutable, and an unknown key is an error, not a silent default."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def engine_section(value: object) -> object:
    """A bare engine type (`rollout.engine: vllm`, `trainer.engine: fsdp`) as that engine's
    section with its defaults (a field's before-validator; the `type` picks the section)."""
    if isinstance(value, dict) and "type" not in value:
        raise ValueError("an engine section names its engine in `type` (e.g. `type: vllm`)")
    return {"type": value} if isinstance(value, str) else value
