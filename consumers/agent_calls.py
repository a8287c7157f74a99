"""Episodes of the user's agent code (`agent.function`) through the OpenAI-compatible endpoint.

    EpisodeRunner.run(prompt, i), with agent.function set -> run_agent(...)
        base_url = endpoint.open(calls.complete)           one URL per episode
        reward = await function(base_url, task)             the user's code, any framework
            each POST .../chat/completions -> AgentCalls.complete(request):
                the request's messages (+ tools) -> the chat template -> token ids
                first call: the episode's first prompt (`EpisodeTokens`)
                later: `EpisodeTokens.add_conversation`: it extends the tokens so far? the
                       new tokens are appended (mask 0) -> ONE sample for the whole episode;
                       it does not (the agent rewrote its history)? a new sample
                -> one model turn through the worker's engine copies (sticky to one copy)
                -> the chat.completion: the text, and `tool_calls` parsed from it
        -> the episode's trajectory (`EpisodeRunner.trajectory`), its reward the function's

Token-exact across calls: an agent sends its whole history with every call, the assistant
messages as the API returned them (`tool_calls` as structured objects). A template renders
those its own way, not as the text the model sampled, and the next render would not extend
the tokens. So each assistant message we returned is remembered with the text the model
sampled, and when it comes back it is rendered as that text, as the episode runner renders its
own turns (the pattern AReaL, rLLM and slime converged on). An assistant message we did not
return (the agent wrote or edited it) is rendered as given, and may start a new sample.

Not durable: the agent's own state lives in its code, so a worker killed mid-episode restarts
the episode from the start on another worker (the environment path resumes from the last turn).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol

from opentelemetry import context
from transformers import PreTrainedTokenizerBase

from bus import tracing
from bus.worker import Reject
from consumers.agent_endpoint import AgentEndpoint, EndpointError
from engines.environment import AgentFunction, call_agent
from engines.episode import EpisodeTokens
from engines.protocols import Sample
from engines.tools import ParsedCalls, parse_tool_calls, prompt_with_tools
from schemas import PromptEvent, TrajectoryEvent
from schemas.episode_state import EpisodeProgress


class Turns(Protocol):
    """What an agent-code episode takes from the episode runner (`consumers.episodes`)."""

    tokenizer: PreTrainedTokenizerBase

    def new_episode(
        self, messages: list[dict[str, Any]], template_tools: list[dict[str, Any]] | None
    ) -> EpisodeTokens: ...

    async def turn(
        self,
        prompt: PromptEvent,
        episode: EpisodeTokens,
        key: str,
        progress: EpisodeProgress,
        limit: int | None = None,
    ) -> Sample: ...

    def trajectory(
        self, prompt: PromptEvent, index: int, episode: EpisodeTokens, progress: EpisodeProgress
    ) -> TrajectoryEvent: ...


def prompt_messages(prompt: PromptEvent) -> list[dict[str, Any]]:
    """The prompt as chat messages: its own, or its text as one user message."""
    if prompt.messages is not None:
        return [dict(m) for m in prompt.messages]
    if prompt.prompt:
        return [{"role": "user", "content": prompt.prompt}]
    raise Reject("an episode needs the prompt's messages or text (token ids alone: no chat)")


Signature = tuple[str, tuple[tuple[str, str], ...]]
"""An assistant message as the agent sends it back: its text and (name, arguments) calls."""


def signature(message: dict[str, Any]) -> Signature:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments", "{}")
        try:  # the API's arguments are a JSON string; compare them as values
            arguments = json.dumps(json.loads(arguments), sort_keys=True)
        except (TypeError, json.JSONDecodeError):
            arguments = str(arguments)
        calls.append((str(function.get("name", "")), arguments))
    return (str(message.get("content") or ""), tuple(calls))


def completion(n: int, text: str, parsed: ParsedCalls | None, finish: str) -> dict[str, Any]:
    """The chat.completion for one model turn (OpenAI's shape: one choice)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if parsed is not None and parsed.calls:
        message["content"] = parsed.text or None
        message["tool_calls"] = [
            {
                "id": f"call_{n}_{i}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for i, call in enumerate(parsed.calls)
        ]
        finish = "tool_calls"
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "policy",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }


class AgentCalls:
    """One episode of agent code: each chat completion request is one model turn."""

    def __init__(
        self, runner: Turns, prompt: PromptEvent, index: int, progress: EpisodeProgress
    ) -> None:
        self.runner, self.prompt, self.index, self.progress = runner, prompt, index, progress
        self.episode: EpisodeTokens | None = None
        self.sampled: dict[Signature, str] = {}
        """Each assistant message returned, as the agent will send it back -> the model's text."""
        self.lock = asyncio.Lock()  # one call at a time: turns of one episode are sequential
        self.trace = context.get_current()
        """The episode's span: a call arrives on the endpoint's connection, outside it."""

    async def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        async with self.lock:
            if request.get("stream"):
                raise EndpointError(400, "stream: true is not served; ask without streaming")
            messages = request.get("messages")
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
            ):
                raise EndpointError(400, "messages: a list of objects with a role is required")
            episode = self.extended(messages, request.get("tools") or [])
            limit = request.get("max_completion_tokens") or request.get("max_tokens")
            runner = self.runner
            key = f"{self.prompt.id}/{self.index}"
            with tracing.tracer.start_as_current_span(
                "turn", context=self.trace, attributes={"jetrl.turn": episode.turns}
            ) as span:
                sample = await runner.turn(self.prompt, episode, key, self.progress, limit)
                assert sample.versions is not None  # `EngineCopies.samples` sets them
                text = episode.add_model_turn(
                    sample.token_ids.tolist(), sample.logprobs.tolist(), sample.versions.tolist()
                )
                span.set_attribute("jetrl.tokens_added", len(sample.token_ids))
            self.progress.turns = episode.turns
            self.progress.cut = sample.finish_reason == "length"
            parsed = parse_tool_calls(text) if request.get("tools") else None
            if parsed is not None:
                self.progress.tool_calls += len(parsed.calls)
                self.progress.tool_errors += len(parsed.errors)
            answer = completion(episode.turns, text, parsed, sample.finish_reason)
            self.sampled[signature(answer["choices"][0]["message"])] = text
            return answer

    def extended(self, messages: list[dict[str, Any]], tools: list[Any]) -> EpisodeTokens:
        """The episode with the request's conversation in it, ready for a model turn."""
        conversation = [self.as_sampled(m) for m in messages]
        conversation, template_tools = prompt_with_tools(self.runner.tokenizer, conversation, tools)
        try:
            if self.episode is None:
                self.episode = self.runner.new_episode(conversation, template_tools)
            elif not self.episode.finished:
                self.episode.add_conversation(conversation)
        except Reject as exc:  # the model cannot take it (too long, outside its vocabulary)
            raise EndpointError(400, str(exc)) from None
        except Exception as exc:  # a template that cannot render what the agent sent
            reason = f"cannot render the messages: {type(exc).__name__}: {exc}"
            raise EndpointError(400, reason) from None
        if self.episode.finished:
            raise EndpointError(400, f"the episode has ended ({self.episode.reason})")
        return self.episode

    def as_sampled(self, message: dict[str, Any]) -> dict[str, Any]:
        """An assistant message we returned, as the text the model sampled; others as sent."""
        if message.get("role") == "assistant":
            text = self.sampled.get(signature(message))
            if text is not None:
                return {"role": "assistant", "content": text}
        return dict(message)


async def run_agent(
    runner: Turns,
    function: AgentFunction,
    endpoint: AgentEndpoint,
    prompt: PromptEvent,
    index: int,
) -> TrajectoryEvent:
    """Episode `index` of `prompt`: the agent function, through an endpoint URL of its own."""
    progress = EpisodeProgress()
    await endpoint.ready.wait()
    task = {**prompt.task, "messages": prompt_messages(prompt)}
    started = time.perf_counter()
    with tracing.tracer.start_as_current_span(
        "episode", attributes={"jetrl.prompt_id": prompt.id, "jetrl.sample_index": index}
    ) as span:
        calls = AgentCalls(runner, prompt, index, progress)
        base_url = endpoint.open(calls.complete)
        try:
            progress.reward = await call_agent(function, base_url, task)
            end, reason = "done", ""
        except Exception as exc:  # the user's agent: this episode fails, the run goes on
            end, reason = "failed", f"agent.function raised {type(exc).__name__}: {exc}"
        finally:
            endpoint.close(base_url)
        span.set_attribute("jetrl.turns", progress.turns)
        span.set_attribute("jetrl.end", end)
    progress.timings["episode"] = time.perf_counter() - started
    episode = calls.episode
    if episode is None:
        raise Reject(f"the agent made no chat completion call ({reason or 'it returned'})")
    if not episode.finished:
        episode.finish("failed" if end == "failed" else "done", reason)
    progress.end, progress.reason = episode.end or "done", reason or episode.reason
    progress.samples = len(episode.samples)
    return runner.trajectory(prompt, index, episode, progress)
