"""An agent episode as the rollout worker records it after each completed turn: what another
worker needs to resume it with the same tokens (`consumers.episodes`, issue 27).

    episode.<prompt id>.<sample>  (the run's KV bucket, `bus.channels.EPISODES`)
        EpisodeState
            tokens:   TokensState    the token samples so far (`engines.episode.EpisodeTokens`):
                                     the conversation's messages, the finished samples, the
                                     one being built, how the episode ended (if it has)
            progress: EpisodeProgress  the runner's count: turns, tool calls, timings, ...
            worker                   the worker that wrote it

Written after a turn's environment part is appended (the tool results, the environment's
reply) and once more when the episode ends; deleted when the prompt's trajectories are all
stored. A worker killed in between costs at most the turn it was in.

Token ids, masks, log-probs and versions are JSON lists here (a record of a few thousand
tokens is tens of KB: the KV value limit is the server's max payload, 1 MiB by default).

This module knows nothing of NATS.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from schemas.kv_records import KvRecord

EpisodeEnd = Literal["done", "failed", "max_turns", "max_tokens"]
"""Why an episode ended: the environment or the model said it is over ("done"), it failed
(a reason with it), or a budget ran out."""
SampleEnd = Literal["continued", "done", "failed", "max_turns", "max_tokens"]
"""Why a sample ended: the episode went on in a new sample ("continued"), or the episode's end."""


class SampleState(BaseModel):
    """One sample of an episode, as built so far (or finished, with its `end`)."""

    model_config = ConfigDict(extra="forbid")

    prompt: list[int]
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    turns: int = 0
    end: SampleEnd | None = None
    reason: str = ""


class TokensState(BaseModel):
    """`EpisodeTokens` between two turns (`EpisodeTokens.state` / `EpisodeTokens.resume`)."""

    model_config = ConfigDict(extra="forbid")

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    """The tools' schemas the chat template renders (None: none, or the template ignores them
    and they are in the system message)."""
    turns: int
    samples: list[SampleState] = []
    """The finished samples (an episode whose render stopped extending its tokens has more
    than one)."""
    current: SampleState
    end: EpisodeEnd | None = None
    reason: str = ""


class EpisodeProgress(BaseModel):
    """What one episode did beside its tokens: `task["episode"]` of its trajectory."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    end: EpisodeEnd = "done"
    reason: str = ""
    reward: float | None = None
    """The environment's reward at the end (None: it gave none)."""
    turn_rewards: list[float] = []
    """One per model turn of the episode, in order: the reward of the environment's step that
    answered it and did not end the episode (None read as 0); 0 for a turn answered by tools
    and for the turn the ending step answered (its reward is `reward`, the outcome)."""
    samples: int = 0
    resumed: int = 0
    """Times another worker took the episode over from its last recorded turn."""
    cut: bool = False
    """The last model turn stopped at its token limit (no end of turn): an episode it ended
    reads as cut (`finish_reason` "length"), as a single-turn sample would."""
    timings: dict[str, float] = Field(
        default_factory=lambda: {"generate": 0.0, "tools": 0.0, "environment": 0.0}
    )

    def as_task(self) -> dict[str, Any]:
        """`task["episode"]` of the trajectory (the episode's turn rewards: the stored sample's
        are put there by the runner, `schemas.turn_rewards.sample_turn_rewards`)."""
        return self.model_dump(exclude={"cut", "timings", "turn_rewards"})


class EpisodeState(KvRecord):
    """`episode.<prompt id>.<sample>`: an episode after its last completed turn."""

    tokens: TokensState
    progress: EpisodeProgress
    worker: str
    """The worker that wrote it (`Runtime.source`)."""
