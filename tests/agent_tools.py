"""Functions the agent tests load as tools by `module:function` name."""

from __future__ import annotations

import asyncio
from typing import Any

NOT_A_FUNCTION = 3


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


def lookup(key: str, default: str = "none") -> dict[str, str]:
    """Look a key up.

    Args:
        key: What to look up.
        default: What to answer when the key is unknown.
    """
    return {"key": key, "value": default}


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def undocumented(x: int) -> int:
    return x


class AskAgain:
    """An environment for the rollout tests (`agent.environment`): after the model's first
    answer it asks "Are you sure?", and the second answer ends the episode with reward 1.0 if
    it says 42. With `hold`, each episode's first step waits for `release` (the test loads new
    weights meanwhile); `held` counts the episodes waiting there. `turn_reward`: the reward of
    the first step (the one that asks again), for `agent.turn_rewards`."""

    def __init__(self, hold: bool = False, turn_reward: float | None = None) -> None:
        self.hold = hold
        self.turn_reward = turn_reward
        self.held = 0
        self.release = asyncio.Event()

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return [dict(m) for m in task["messages"]]

    async def step(
        self, messages: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], float | None, bool]:
        if sum(m["role"] == "user" for m in messages) == 1:
            if self.hold:
                self.held += 1
                await self.release.wait()
            return [{"role": "user", "content": "Are you sure?"}], self.turn_reward, False
        return [], float("42" in messages[-1]["content"]), True


def two_calls(base_url: str, task: dict[str, Any], edit: bool = False) -> float:
    """An agent (`agent.function`) written with the real `openai` client, as a user writes one:
    ask with the `add` tool, run the calls it gets, ask again; 1.0 if the answer says 42. With
    `edit`, it rewrites the model's first turn in its history before asking again."""
    import json

    import openai

    from engines.tools import load_tool

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    tools: Any = [load_tool("tests.agent_tools:add").schema]
    messages: list[Any] = list(task["messages"])
    first = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    message = first.choices[0].message
    mine = {"role": "assistant", "content": "I asked the calculator."}
    messages.append(mine if edit else message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
        result = add(**arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    second = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    return float("42" in (second.choices[0].message.content or ""))


def edits_history(base_url: str, task: dict[str, Any]) -> float:
    """`two_calls` that rewrites the model's first turn before its second call."""
    return two_calls(base_url, task, edit=True)
