"""`agent`: multi-turn episodes (`consumers.episodes`): the environment, its tools, the budgets.

Absent (the default), a rollout worker makes one single-turn sample per prompt sample, as
always. Present, each of a prompt's `data.n` samples is an episode: model turns and
environment turns (tool results, the environment's messages) up to `max_turns` and
`max_tokens`, ending in one trajectory whose `response_mask` marks the model's tokens.
How tool calls run (sandbox, time limit, caps) is the `tools` section.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from schemas.section import Section


def module_attribute(value: str) -> str:
    """`value` when it is `module:name` (the form tools and environments are named in)."""
    module, sep, name = value.partition(":")
    if not sep or not module or not name.isidentifier():
        raise ValueError(f"{value!r}: name it as module:name (e.g. my_agent.tools:search)")
    return value


class AgentConfig(Section):
    environment: str | None = None
    """The environment class as `module:Class`, built once per worker as
    `Class(**environment_options)`: `reset(task) -> messages` starts an episode,
    `step(messages) -> (new messages, reward, done)` answers a model turn with no tool call
    (`engines.environment`). None: the prompt's own messages, and the episode is done at the
    first model turn with no tool call (a tool-using single question)."""
    function: str | None = None
    """Agent code instead of an environment: an `async` or plain function as `module:function`,
    called once per episode as `function(base_url, task)` with a base URL of the rollout
    worker's OpenAI-compatible endpoint (`consumers.agent_endpoint`) for the `openai` client or
    any framework; every chat completion it asks for is a model turn of the episode. It returns
    the episode's reward (a number), or None for `data.reward` to score the trajectory. Not
    with `environment` or `tools` (the agent's requests carry its tools)."""
    environment_options: dict[str, Any] = {}
    """Keyword arguments of the environment class."""
    tools: list[str] = []
    """The tools the model may call, each a function as `module:function`; their JSON schemas
    come from the signature and docstring (`engines.tools.load_tool`) and are shown to the model
    through the chat template (or its system message where the template ignores `tools`)."""
    max_turns: int = Field(4, ge=1)
    """Most model turns in an episode; the episode ends with `max_turns` after the last."""
    max_tokens: int | None = Field(None, ge=2)
    """Most tokens in an episode's context (prompt + every turn so far): the next model turn
    may generate only what is left. None: the model's context length."""
    max_episodes: int = Field(64, ge=1)
    """Episodes in flight at once in one rollout worker. Their model turns share the engine
    copies' slots (a turn waits for one like any sample), and a turn waiting on a tool holds
    no slot."""
    turn_rewards: bool = False
    """Credit each model turn with the reward the environment's `step` gave it (a step that did
    not end the episode; the ending step's reward is the outcome, added once at the last token
    as without the option), on the turn's last token (`schemas.turn_rewards`). Needs
    `algorithm.advantage: gae` and `agent.environment`: a reward in the middle of a response
    means something only against a per-token value baseline (GAE's critic), where it changes
    the advantages of that turn's tokens and the earlier ones; a per-sequence estimator (GRPO,
    RLOO, ...) has one advantage for the whole response and would fold it into a sum. And only an
    environment's `step` gives rewards before the end. False: the reward is per episode."""

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[str]) -> list[str]:
        for spec in value:
            module_attribute(spec)
        if len(set(value)) != len(value):
            raise ValueError(f"a tool is named twice: {value}")
        return value

    @field_validator("function")
    @classmethod
    def _function(cls, value: str | None) -> str | None:
        return None if value is None else module_attribute(value)

    @model_validator(mode="after")
    def _one_way(self) -> AgentConfig:
        if self.function is not None and (self.environment is not None or self.tools):
            raise ValueError(
                "agent.function runs the agent's own code: no agent.environment or agent.tools "
                "with it (its requests carry its tools)"
            )
        return self

    @field_validator("environment")
    @classmethod
    def _environment(cls, value: str | None) -> str | None:
        return None if value is None else module_attribute(value)
