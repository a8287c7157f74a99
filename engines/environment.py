"""An agent's environment: how an episode starts and how it answers a model turn.

    reset(task) -> messages                     the episode's first messages
    step(messages) -> (new messages, reward, done)
        called after each model turn that made no tool call (tool calls are the runner's:
        `consumers.episodes`), with the whole conversation so far, the model's turn last:
        new messages go on the conversation (a user's reply, feedback), `reward` is the
        episode's reward when `done` (None: `data.reward` scores the trajectory), `done`
        ends the episode. A reward on a step that is not done is the reward of the turn it
        answered, trained only with `agent.turn_rewards` (`schemas.turn_rewards`).

An environment is named in the config as `module:Class` (`agent.environment`) and built once
per rollout worker with `agent.environment_options`; `reset` and `step` may be plain or
`async` methods. One instance serves every episode of the worker, so it keeps no per-episode
state on itself: what an episode needs travels in its task and its messages.

`PromptEnvironment`, the default, is a single question with tools: the prompt's messages,
and the first model turn without a tool call is the answer (done, reward from `data.reward`).

Knows no bus and no stage: pure Python, testable with a scripted model.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol, cast

from engines.episode import Message


class Step(NamedTuple):
    """What an environment answers a model turn with."""

    messages: list[Message]
    reward: float | None
    done: bool


class Environment(Protocol):
    def reset(self, task: dict[str, Any]) -> list[Message] | Awaitable[list[Message]]: ...

    def step(
        self, messages: Sequence[Message]
    ) -> tuple[list[Message], float | None, bool] | Awaitable[Any]: ...


class EnvironmentLoadError(ValueError):
    """The configured environment cannot be built (one line naming the cause)."""


class PromptEnvironment:
    """The default: the prompt's messages (`task["messages"]`, put there by the runner), done
    at the first answer; `data.reward` scores it."""

    def reset(self, task: dict[str, Any]) -> list[Message]:
        return [dict(m) for m in task["messages"]]

    def step(self, messages: Sequence[Message]) -> tuple[list[Message], float | None, bool]:
        return [], None, True


def _attribute(spec: str, setting: str) -> tuple[Any, str, str]:
    """What `spec` (`module:name`) names, with the module's and the attribute's names;
    EnvironmentLoadError naming `setting` and the cause when the module does not import."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: whatever its import raises, named
        raise EnvironmentLoadError(
            f"{setting} {spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})"
        ) from None
    return getattr(module, name, None), module_name, name


def load_environment(spec: str | None, options: dict[str, Any]) -> Environment:
    """`spec` (`module:Class`) built with `options`; `PromptEnvironment` for None."""
    if spec is None:
        return PromptEnvironment()
    cls, module_name, name = _attribute(spec, "agent.environment")
    if cls is None:
        raise EnvironmentLoadError(f"agent.environment {spec!r}: {module_name!r} has no {name!r}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvironmentLoadError(f"agent.environment {spec!r}: no {' or '.join(missing)} method")
    try:
        return cast(Environment, cls(**options))
    except Exception as exc:
        raise EnvironmentLoadError(
            f"agent.environment {spec!r}: {name}(**environment_options) raised "
            f"{type(exc).__name__}: {exc}"
        ) from None


AgentFunction = Callable[[str, dict[str, Any]], Any]
"""`agent.function`: `(base_url, task) -> reward | None`, plain or `async`."""


def load_agent_function(spec: str) -> AgentFunction:
    """The function `spec` (`module:function`) names; EnvironmentLoadError naming the cause."""
    function, module_name, name = _attribute(spec, "agent.function")
    if not callable(function):
        raise EnvironmentLoadError(
            f"agent.function {spec!r}: {module_name!r} has no function {name!r}"
        )
    return cast(AgentFunction, function)


async def call_agent(function: AgentFunction, base_url: str, task: dict[str, Any]) -> float | None:
    """`function(base_url, task)`: awaited when async, else in a thread (an agent on a blocking
    client must not hold the worker's event loop); its reward, checked."""
    if inspect.iscoroutinefunction(function):
        value = await function(base_url, task)
    else:
        value = await asyncio.to_thread(function, base_url, task)
    if value is not None and not isinstance(value, int | float):
        raise TypeError(f"the agent returned {type(value).__name__}, not a reward or None")
    return None if value is None else float(value)


async def reset(environment: Environment, task: dict[str, Any]) -> list[Message]:
    """`environment.reset(task)`, awaited if it is async; checked to be a list of messages."""
    value = environment.reset(task)
    if inspect.isawaitable(value):
        value = await value
    return _messages(value, "reset")


async def step(environment: Environment, messages: Sequence[Message]) -> Step:
    """`environment.step(messages)`, awaited if it is async; checked to be
    (messages, reward, done)."""
    value = environment.step(list(messages))
    if inspect.isawaitable(value):
        value = await value
    if not (isinstance(value, tuple) and len(value) == 3):
        raise TypeError(f"step returned {type(value).__name__}, not (messages, reward, done)")
    new, reward, done = value
    if reward is not None and not isinstance(reward, int | float):
        raise TypeError(f"step returned a reward of type {type(reward).__name__}")
    return Step(_messages(new, "step"), None if reward is None else float(reward), bool(done))


def _messages(value: object, method: str) -> list[Message]:
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value
    ):
        raise TypeError(f"{method} returned {value!r:.80}, not a list of messages with a role")
    return [dict(m) for m in value]


def environment_reward(response_text: str, task: dict[str, Any]) -> float:
    """`data.reward` for an environment that rewards its episodes: the reward its `step` gave
    at the end (`task["episode"]["reward"]`, set by the rollout worker). Raises for an episode
    the environment gave none (failed, or ended by a budget), so the reward says why."""
    episode = task.get("episode") or {}
    reward = episode.get("reward")
    if reward is None:
        raise ValueError(f"the environment gave no reward (episode ended: {episode.get('end')})")
    return float(reward)
