"""The rollout worker's agent episodes (`agent` in the run config): one trajectory per episode.

    Rollout.handle(prompt), with `agent` set: the prompt's n samples are n episodes, run at
    once (at most `agent.max_episodes` in the worker), each stored as soon as it ends
    EpisodeRunner.run(prompt, index):
        environment.reset(task) -> messages (+ the tools' schemas: the template's `tools=`,
            or a system message where the template ignores them)
        -> `EpisodeTokens` renders them: the first prompt's tokens
        loop, one model turn at a time:
            turn: the tokens so far as a one-sample prompt of at most `room()` new tokens,
                through the worker's engine copies (`EngineCopies.samples`: the gate, the
                slots, the router -- keyed by the episode, so its turns stick to one copy)
                -> appended as sampled (mask 1, log-probs, each token's weight version)
            tool calls in the turn's text (`engines.tools.parse_tool_calls`)?
                yes -> each runs in the episode's sandboxed tool process
                       (`consumers.tool_runner`; no engine slot is held meanwhile) -> the
                       results, as tool messages, are rendered and appended (mask 0); a
                       call that hung, crashed or went over a cap fails the episode
                no  -> environment.step(messages) -> (messages, reward, done): done ends
                       the episode; else its messages are appended (mask 0)
            a budget (`agent.max_turns`, `agent.max_tokens`) ends it in between
        -> the episode as one `TrajectoryEvent`: its last sample with its `response_mask`,
           the samples before it (if its render stopped extending its tokens) in `earlier`

What the trajectory carries for the reward: `response_text` is the whole response decoded
without special tokens (the model's turns and the tool results between them), and `task` is
the prompt's task plus `task["episode"]`: turns, tool calls, how it ended and why, and the
environment's reward (None when it gave none). `data.reward` scores it as any trajectory;
`engines.environment:environment_reward` returns the environment's.

Decided here (issue 27 leaves it open):
- A failed episode (a tool hung, crashed or flooded; the environment raised) is stored like
  any other, its trajectory's `finish_reason` "error" and the reason in `task["episode"]`, so
  its group completes and the run goes on; its reward is what `data.reward` gives it.
- An episode whose render stopped extending its tokens (`EpisodeTokens`: a template that drops
  earlier reasoning) trains EVERY sample: the samples before its last travel inside its one
  trajectory as `earlier` segments (`schemas.segment`), and the buffer packs a row per segment
  with the episode's advantage. One trajectory per episode keeps a group at `data.n`, so the
  buffer's group accounting, dedup ids, crash points and dead-lettering are untouched (a
  trajectory per sample would make groups of a variable size). `task["episode"]["samples"]`
  counts them; with `agent.turn_rewards`, the turn rewards cover every segment's turns in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from opentelemetry import context
from transformers import PreTrainedTokenizerBase

from bus import tracing
from bus.crashpoints import ROLLOUT_BETWEEN_TURNS, ROLLOUT_MID_TOOL_CALL
from bus.worker import Reject
from consumers.agent_calls import prompt_messages, run_agent
from consumers.agent_endpoint import AgentEndpoint
from consumers.checks import ModelLimits
from consumers.episode_journal import EpisodeJournal
from consumers.rollout_copies import EngineCopies, Pending
from consumers.tool_runner import ToolEpisode, ToolRunner
from engines import environment as env
from engines.episode import EpisodeSample, EpisodeTokens
from engines.protocols import Sample
from engines.tools import parse_tool_calls, prompt_with_tools
from schemas import PromptEvent, Segment, Tensor, TrajectoryEvent
from schemas.agent_config import AgentConfig
from schemas.episode_state import EpisodeEnd, EpisodeProgress
from schemas.events import FinishReason
from schemas.tools_config import ToolsConfig
from schemas.turn_rewards import sample_turn_rewards

log = logging.getLogger("jetrl.episodes")

FINISH: dict[EpisodeEnd, FinishReason] = {
    "done": "stop",
    "max_turns": "length",
    "max_tokens": "length",
    "failed": "error",
}
"""An episode's end as its trajectory's `finish_reason` (a budget reads as the length limit:
DAPO's overlong filter treats it as a cut response)."""


class EpisodeRunner:
    """Runs a rollout worker's episodes on its engine copies, tools and environment."""

    def __init__(
        self,
        agent: AgentConfig,
        tools: ToolsConfig,
        tokenizer: PreTrainedTokenizerBase,
        copies: EngineCopies,
        limits: ModelLimits,
        journal: EpisodeJournal,
        *,
        source: str,
        engine: str,
    ) -> None:
        self.agent, self.tokenizer, self.copies, self.limits = agent, tokenizer, copies, limits
        self.journal, self.source, self.engine = journal, source, engine
        if not getattr(tokenizer, "chat_template", None):
            raise env.EnvironmentLoadError(
                "agent: the model's tokenizer has no chat template, and an episode is a chat "
                "(use a chat model, or a model directory whose tokenizer_config.json has one)"
            )
        self.environment = env.load_environment(agent.environment, agent.environment_options)
        self.agent_function = (
            None if agent.function is None else env.load_agent_function(agent.function)
        )
        self.endpoint = None if agent.function is None else AgentEndpoint()
        """With `agent.function`: the worker's OpenAI-compatible endpoint
        (`consumers.agent_calls`)."""
        self.tool_runner = ToolRunner(agent.tools, tools)  # a bad tool name fails the start
        self.schemas = [tool.schema for tool in self.tool_runner.tools.values()]
        self.max_tokens = agent.max_tokens or limits.context or 4096
        self.in_flight = asyncio.Semaphore(agent.max_episodes)
        self.tools_ready = asyncio.Event()

    async def serve_tools(self) -> None:
        """The stage's "tool runner" helper: the runner entered (its sandbox chosen, and
        logged, once) for the stage's life; cancelled with the stage, it ends the episodes'
        tool processes."""
        async with self.tool_runner:
            self.tools_ready.set()
            await asyncio.Future()  # until the stage cancels it

    async def run(self, prompt: PromptEvent, index: int) -> TrajectoryEvent:
        """Episode `index` of `prompt`, to its end; its trajectory. Reject for a prompt no
        episode can start from (no messages, too long, tokens outside the vocabulary)."""
        async with self.in_flight:
            if self.agent_function is not None and self.endpoint is not None:
                return await run_agent(self, self.agent_function, self.endpoint, prompt, index)
            with tracing.tracer.start_as_current_span(
                "episode", attributes={"jetrl.prompt_id": prompt.id, "jetrl.sample_index": index}
            ) as span:
                started = time.perf_counter()
                episode, progress = await self.resume_or_start(prompt, index)
                if not episode.finished:
                    await self.tools_ready.wait()
                    async with self.tool_runner.episode() as tools:
                        await self.play(prompt, index, episode, tools, progress)
                    await self.journal.record(prompt.id, index, episode.state(), progress)
                span.set_attribute("jetrl.turns", progress.turns)
                span.set_attribute("jetrl.end", progress.end)
                span.set_attribute("jetrl.resumed", progress.resumed)
            progress.timings["episode"] = time.perf_counter() - started
            return self.trajectory(prompt, index, episode, progress)

    async def resume_or_start(
        self, prompt: PromptEvent, index: int
    ) -> tuple[EpisodeTokens, EpisodeProgress]:
        """The episode where a worker that held the prompt before recorded it, or a new one."""
        state = await self.journal.recall(prompt.id, index)
        if state is None:
            return await self.start(prompt), EpisodeProgress()
        episode = EpisodeTokens.resume(
            self.tokenizer,
            state.tokens,
            max_turns=self.agent.max_turns,
            max_tokens=self.max_tokens,
        )
        progress = state.progress.model_copy(update={"resumed": state.progress.resumed + 1})
        log.info(
            "episode %s/%d resumed after turn %d (recorded by %s)",
            prompt.id,
            index,
            episode.turns,
            state.worker,
        )
        return episode, progress

    async def start(self, prompt: PromptEvent) -> EpisodeTokens:
        """The episode's first messages, rendered: checked against the model before a turn."""
        messages = prompt_messages(prompt)
        try:
            first = await env.reset(self.environment, {**prompt.task, "messages": messages})
        except Exception as exc:  # the user's environment: the prompt can never start
            raise Reject(f"agent.environment reset raised {type(exc).__name__}: {exc}") from None
        first, template_tools = prompt_with_tools(self.tokenizer, first, self.schemas)
        return self.new_episode(first, template_tools)

    def new_episode(
        self, messages: list[dict[str, Any]], template_tools: list[dict[str, Any]] | None
    ) -> EpisodeTokens:
        """An episode's first messages, rendered: checked against the model before a turn."""
        try:
            episode = EpisodeTokens(
                self.tokenizer,
                messages,
                tools=template_tools,
                max_turns=self.agent.max_turns,
                max_tokens=self.max_tokens,
            )
        except Exception as exc:  # a template that cannot render these messages
            raise Reject(
                f"cannot render the episode's messages: {type(exc).__name__}: {exc}"
            ) from None
        tokens = episode.tokens
        self.limits.check(max(tokens), len(tokens) + 1, f"episode prompt of {len(tokens)} tokens")
        if episode.finished:
            raise Reject(f"no room for a model turn: {episode.reason}")
        return episode

    async def play(
        self,
        prompt: PromptEvent,
        index: int,
        episode: EpisodeTokens,
        tools: ToolEpisode,
        progress: EpisodeProgress,
    ) -> None:
        """Model turn, then tools or the environment, until the episode ends (see the module
        doc)."""
        key = f"{prompt.id}/{index}"  # the router's sticky key: the episode's turns on one copy
        while not episode.finished:
            with tracing.tracer.start_as_current_span(
                "turn", attributes={"jetrl.turn": episode.turns}
            ) as span:
                sample = await self.turn(prompt, episode, key, progress)
                assert sample.versions is not None  # `EngineCopies.samples` sets them
                text = episode.add_model_turn(
                    sample.token_ids.tolist(), sample.logprobs.tolist(), sample.versions.tolist()
                )
                progress.turns = episode.turns
                progress.turn_rewards = [*progress.turn_rewards, 0.0]
                progress.cut = sample.finish_reason == "length"
                span.set_attribute("jetrl.tokens_added", len(sample.token_ids))
            parsed = parse_tool_calls(text) if self.schemas else None
            if parsed is not None and (parsed.calls or parsed.errors):
                results = await self.call_tools(parsed, tools, progress, key)
                if results is None:
                    episode.finish("failed", progress.reason)
                    break
                if episode.add_environment(results):
                    await self.turn_done(prompt, index, episode, progress)
                continue
            try:
                started = time.perf_counter()
                answer = await env.step(self.environment, episode.messages)
                progress.timings["environment"] += time.perf_counter() - started
            except Exception as exc:  # the user's environment: the episode fails, the run goes on
                progress.reason = f"agent.environment step raised {type(exc).__name__}: {exc}"
                episode.finish("failed", progress.reason)
                break
            if answer.done:  # the ending step's reward is the outcome, never a turn's
                progress.reward = answer.reward
                episode.finish("done")
                break
            if answer.reward is not None:  # the turn it answered (`agent.turn_rewards`)
                progress.turn_rewards = [*progress.turn_rewards[:-1], answer.reward]
            if episode.add_environment(answer.messages):
                await self.turn_done(prompt, index, episode, progress)
        progress.end = episode.end or "done"
        progress.reason = progress.reason or episode.reason
        progress.samples = len(episode.samples)
        if progress.end == "failed":
            log.warning("episode %s/%d failed: %s", prompt.id, index, progress.reason)

    async def turn_done(
        self, prompt: PromptEvent, index: int, episode: EpisodeTokens, progress: EpisodeProgress
    ) -> None:
        """A turn and its environment part are in: recorded, so another worker resumes here."""
        await self.journal.record(prompt.id, index, episode.state(), progress)
        ROLLOUT_BETWEEN_TURNS(f"{prompt.id}/{index} after turn {episode.turns}")

    async def turn(
        self,
        prompt: PromptEvent,
        episode: EpisodeTokens,
        key: str,
        progress: EpisodeProgress,
        limit: int | None = None,
    ) -> Sample:
        """One model turn: the tokens so far as a one-sample prompt, through the copies, of
        at most `limit` (else the prompt's `max_tokens`) new tokens, within the episode's room."""
        room = min(episode.room(), limit or prompt.sampling.max_tokens)
        sampling = prompt.sampling.model_copy(update={"max_tokens": room})
        one = prompt.model_copy(update={"n": 1, "sampling": sampling})
        started = time.perf_counter()
        pending = Pending(
            one,
            episode.tokens,
            started,
            asyncio.get_running_loop().create_future(),
            context.get_current(),
        )
        generated = self.copies.samples(pending, key)
        async with contextlib.aclosing(generated):
            async for _, sample, _ in generated:
                progress.timings["generate"] += time.perf_counter() - started
                return sample
        raise RuntimeError("the engine copies returned no sample for a turn")

    async def call_tools(
        self, parsed: Any, tools: ToolEpisode, progress: EpisodeProgress, key: str
    ) -> list[dict[str, Any]] | None:
        """The tool messages answering a turn's calls (malformed ones as errors the model
        reads); None when a call failed the episode (`progress.reason` says why)."""
        results = [{"role": "tool", "content": f"error: {error}"} for error in parsed.errors]
        progress.tool_errors += len(parsed.errors)
        for call in parsed.calls:
            progress.tool_calls += 1
            with tracing.tracer.start_as_current_span(
                "tool call", attributes={"jetrl.tool": call.name}
            ) as span:
                calling = asyncio.ensure_future(tools.call(call.name, call.arguments))
                await asyncio.sleep(0)  # the call is under way in the episode's tool process
                ROLLOUT_MID_TOOL_CALL(f"{key} calls {call.name}")
                outcome = await calling
                span.set_attribute("jetrl.ok", outcome.ok)
            progress.timings["tools"] += outcome.seconds
            if outcome.fatal:
                progress.reason = outcome.reason
                return None
            progress.tool_errors += not outcome.ok
            results.append({"role": "tool", "name": call.name, "content": outcome.message})
        return results

    def episode_task(self, progress: EpisodeProgress, sample_turns: int) -> dict[str, Any]:
        """`task["episode"]`; with `agent.turn_rewards`, the turn rewards of the stored samples'
        `sample_turns` model turns (every segment's, in order)."""
        task = progress.as_task()
        if self.agent.turn_rewards:
            task["turn_rewards"] = sample_turn_rewards(progress.turn_rewards, sample_turns)
        return task

    def trajectory(
        self, prompt: PromptEvent, index: int, episode: EpisodeTokens, progress: EpisodeProgress
    ) -> TrajectoryEvent:
        """The episode as the trajectory stored for sample `index`: its last sample in the
        trajectory's own fields, the ones before it in `earlier` (each trained)."""
        if not episode.samples:
            raise Reject(f"the episode made no model turn ({progress.end}: {progress.reason})")
        *before, last = episode.samples
        if before:
            log.info(
                "episode %s/%d: %d samples (the render stopped extending the tokens: %s)",
                prompt.id,
                index,
                len(episode.samples),
                before[0].reason,
            )
        turns = sum(s.turns for s in episode.samples)
        return TrajectoryEvent(
            id=f"{prompt.id}/{index}",
            run=prompt.run,
            source=self.source,
            prompt_id=prompt.id,
            sample_index=index,
            group_size=prompt.n,
            prompt_ids=Tensor.from_numpy(last.prompt_ids),
            response_ids=Tensor.from_numpy(last.response_ids),
            logprobs=Tensor.from_numpy(last.logprobs),
            versions=Tensor.from_numpy(last.versions),
            response_mask=Tensor.from_numpy(last.response_mask),
            earlier=tuple(segment(s) for s in before),
            response_text=self.tokenizer.decode(
                last.response_ids.tolist(), skip_special_tokens=True
            ),
            finish_reason="length"
            if progress.cut and progress.end == "done"
            else FINISH[progress.end],
            task={**prompt.task, "episode": self.episode_task(progress, turns)},
            engine=self.engine,
            timings=progress.timings,
        )


def segment(sample: EpisodeSample) -> Segment:
    """An earlier sample of an episode as its trajectory carries it."""
    return Segment(
        prompt_ids=Tensor.from_numpy(sample.prompt_ids),
        response_ids=Tensor.from_numpy(sample.response_ids),
        logprobs=Tensor.from_numpy(sample.logprobs),
        versions=Tensor.from_numpy(sample.versions),
        response_mask=Tensor.from_numpy(sample.response_mask),
    )
