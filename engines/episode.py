"""One agent episode as token samples: append-only, masked, never re-rendered from text.

An episode is a conversation: model turns (sampled by the engine) and environment turns (tool
results, a user's reply). Training needs the tokens exactly as the model saw and produced
them, so `EpisodeTokens` grows the token stream turn by turn instead of re-tokenising the
conversation:

    initial messages --chat template (add_generation_prompt)--> prompt_ids of sample 0
    model turn (ids, log-probs, version)   --> appended as sampled, mask 1
    environment turn (messages)            --> the WHOLE conversation + these messages rendered
        through the chat template (add_generation_prompt) -> `extension(so_far, rendered)`:
          extends the tokens so far?  yes -> append rendered[len(so_far):], mask 0
                                      no  -> the sample ends as it is ("continued"); a NEW
                                             sample starts whose prompt is that render
    end (done, failed, a budget) --> the samples, each {prompt_ids, response_ids,
        response_mask, logprobs, versions}

Why re-render the whole conversation rather than the new messages alone: the template decides
what goes between turns (the newline after ``<|im_end|>``, a ``<tool_response>`` wrapper, the
next ``<|im_start|>assistant``), and only a render of the whole conversation says it the way
the template does. Why check the prefix: a template may render earlier turns differently from
how they were sampled (one that strips ``<think>`` from earlier assistant turns, a compacted
context), and a tokenizer may tokenise the model's text differently from how it was sampled
(BPE merges the model did not make); appending a suffix to tokens the render does not start
with would train on a sequence the model never saw. Such an episode goes on as a new sample
of the same group, whose prompt is what the model is prompted with from then on; the samples
before it keep their tokens.

A model turn re-enters the conversation as an assistant message whose content is its decoded
text (special tokens kept: ``<tool_call>`` stays text) up to its end-of-turn token (the
tokenizer's eos, e.g. ``<|im_end|>``, by default): the template adds the end of turn and what
follows it itself. Tool calls stay inside that text, not as structured ``tool_calls``: a
template's own serialisation of a call would not be the text the model wrote.

Budgets: `max_turns` model turns and `max_tokens` tokens in a sample (prompt + response: the
context the next turn is generated in). `add_environment` ends the episode, without appending,
when a model turn may not follow (``max_turns``) or would have no room (``max_tokens``);
`room()` is the most tokens the next model turn may generate. The caller ends an episode
itself with "done" (the environment says so, or the model answered) or "failed" (a reason).

Pure apart from the tokenizer calls: the decisions are `extension` and `budget_end`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

from schemas.episode_state import EpisodeEnd, SampleEnd, SampleState, TokensState

Message = dict[str, Any]


class ChatTokenizer(Protocol):
    """What `EpisodeTokens` uses of a Hugging Face tokenizer."""

    @property
    def eos_token_id(self) -> Any: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: Any, **kwargs: Any) -> Any: ...


class EpisodeError(ValueError):
    """A call the episode cannot take (finished already, misaligned arrays, over budget): a bug
    in the caller, not in the model or the environment."""


class Extension(NamedTuple):
    """Whether a render extends the tokens so far, and from where its new tokens start."""

    extends: bool
    start: int
    """Index in the render of the first new token (== len(so_far)) when it extends; else the
    first position where the render and the tokens so far differ."""


def extension(so_far: Sequence[int], rendered: Sequence[int]) -> Extension:
    """Does `rendered` start with exactly `so_far`? If so its suffix from `len(so_far)` is what
    to append; if not, `start` is the first position where they differ (for the reason)."""
    n = min(len(so_far), len(rendered))
    for i in range(n):
        if so_far[i] != rendered[i]:
            return Extension(False, i)
    if len(rendered) < len(so_far):
        return Extension(False, n)
    return Extension(True, len(so_far))


def budget_end(turns: int, max_turns: int, tokens: int, max_tokens: int) -> EpisodeEnd | None:
    """The budget that stops another model turn after `turns` model turns, in a sample of
    `tokens` tokens (the next generation needs at least one token of room); None: go on."""
    if turns >= max_turns:
        return "max_turns"
    if tokens >= max_tokens:
        return "max_tokens"
    return None


@dataclass
class EpisodeSample:
    """One trajectory of an episode: the contract with the trainer (issue 27).

    prompt_ids int32 [P]; response_ids int32 [R]; response_mask uint8 [R] (1: a model token,
    trained; 0: an environment or template token); logprobs float32 [R] (0.0 where the mask is
    0); versions int32 [R] (-1 where the mask is 0, else the weight version that generated it).
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    turns: int
    """Model turns in this sample."""
    end: SampleEnd
    reason: str = ""
    """Why it ended, in words (the mismatch of a "continued" sample, a failure's cause)."""


@dataclass
class _Building:
    """The sample being built, as lists (appended to turn by turn)."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.response

    def append(
        self, ids: Sequence[int], model: bool, logprobs: Sequence[float], versions: Sequence[int]
    ) -> None:
        self.response.extend(ids)
        self.mask.extend([int(model)] * len(ids))
        self.logprobs.extend(logprobs if model else [0.0] * len(ids))
        self.versions.extend(versions if model else [-1] * len(ids))

    def trim_environment(self) -> None:
        """Drop trailing environment tokens: no model turn followed them, so the model never
        conditioned on them."""
        while self.mask and self.mask[-1] == 0:
            for column in (self.response, self.mask, self.logprobs, self.versions):
                column.pop()

    def state(self) -> SampleState:
        return SampleState(
            prompt=self.prompt,
            response=self.response,
            mask=self.mask,
            logprobs=self.logprobs,
            versions=self.versions,
            turns=self.turns,
        )

    @classmethod
    def of(cls, state: SampleState) -> _Building:
        return cls(
            list(state.prompt),
            list(state.response),
            list(state.mask),
            list(state.logprobs),
            list(state.versions),
            state.turns,
        )

    def frozen(self, end: SampleEnd, reason: str) -> EpisodeSample:
        return EpisodeSample(
            prompt_ids=np.asarray(self.prompt, dtype=np.int32),
            response_ids=np.asarray(self.response, dtype=np.int32),
            response_mask=np.asarray(self.mask, dtype=np.uint8),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32),
            turns=self.turns,
            end=end,
            reason=reason,
        )


class EpisodeTokens:
    """The token samples of one episode, built turn by turn (see the module doc)."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        max_turns: int = 8,
        max_tokens: int = 4096,
        end_of_turn: Collection[int] | None = None,
    ) -> None:
        self._configure(tokenizer, tools, max_turns, max_tokens, end_of_turn)
        self.messages: list[Message] = [dict(m) for m in messages]
        """The conversation so far, model turns as assistant messages of their text."""
        self.turns = 0
        self.samples: list[EpisodeSample] = []
        self.end: EpisodeEnd | None = None
        self.reason = ""
        self._current = _Building(prompt=self.render(self.messages))
        if len(self._current.prompt) >= max_tokens:
            self.finish("max_tokens", f"the prompt has {len(self._current.prompt)} tokens")

    def _configure(
        self,
        tokenizer: ChatTokenizer,
        tools: Sequence[dict[str, Any]] | None,
        max_turns: int,
        max_tokens: int,
        end_of_turn: Collection[int] | None,
    ) -> None:
        if max_turns < 1 or max_tokens < 1:
            raise EpisodeError(f"max_turns {max_turns} and max_tokens {max_tokens} must be >= 1")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        if end_of_turn is None:
            eos = tokenizer.eos_token_id
            end_of_turn = [] if eos is None else [eos]
        self.end_of_turn = set(end_of_turn)
        """Token ids that end a model turn (the tokenizer's eos by default)."""

    def state(self) -> TokensState:
        """The episode as it stands, to resume it elsewhere (`resume`) with the same tokens."""
        return TokensState(
            messages=[dict(m) for m in self.messages],
            tools=self.tools,
            turns=self.turns,
            samples=[
                SampleState(
                    prompt=s.prompt_ids.tolist(),
                    response=s.response_ids.tolist(),
                    mask=s.response_mask.tolist(),
                    logprobs=s.logprobs.tolist(),
                    versions=s.versions.tolist(),
                    turns=s.turns,
                    end=s.end,
                    reason=s.reason,
                )
                for s in self.samples
            ],
            current=self._current.state(),
            end=self.end,
            reason=self.reason,
        )

    @classmethod
    def resume(
        cls,
        tokenizer: ChatTokenizer,
        state: TokensState,
        *,
        max_turns: int = 8,
        max_tokens: int = 4096,
        end_of_turn: Collection[int] | None = None,
    ) -> EpisodeTokens:
        """The episode `state` was taken from, token for token: nothing is rendered again (the
        next environment turn renders the whole conversation, as it would have)."""
        episode = cls.__new__(cls)
        episode._configure(tokenizer, state.tools, max_turns, max_tokens, end_of_turn)
        episode.messages = [dict(m) for m in state.messages]
        episode.turns = state.turns
        episode.samples = []
        for sample in state.samples:
            if sample.end is None:
                raise EpisodeError("a finished sample of the state has no end")
            episode.samples.append(_Building.of(sample).frozen(sample.end, sample.reason))
        episode.end, episode.reason = state.end, state.reason
        episode._current = _Building.of(state.current)
        return episode

    def render(self, messages: Sequence[Message]) -> list[int]:
        """`messages` through the chat template, with the generation prompt, as token ids."""
        ids = self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        return [int(i) for i in ids]

    @property
    def finished(self) -> bool:
        return self.end is not None

    @property
    def tokens(self) -> list[int]:
        """The current sample's prompt + response: what the next model turn is generated after."""
        return self._current.tokens

    def room(self) -> int:
        """The most tokens the next model turn may generate (0 once finished)."""
        return 0 if self.finished else max(0, self.max_tokens - len(self._current.tokens))

    def turn_text(self, token_ids: Sequence[int]) -> str:
        """A model turn's text as the conversation carries it: decoded with its special tokens,
        up to (without) its first end-of-turn token; the template adds the end of turn."""
        ids = list(token_ids)
        for i, token in enumerate(ids):
            if token in self.end_of_turn:
                ids = ids[:i]
                break
        text = self.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)
        return text

    def add_model_turn(
        self, token_ids: Sequence[int], logprobs: Sequence[float], version: int | Sequence[int]
    ) -> str:
        """Append a model turn as sampled (mask 1); returns its text (also the content of the
        assistant message it adds to the conversation). `version`: the weight version that
        generated the turn, or one per token (a turn a weight load paused mid-way)."""
        if self.finished:
            raise EpisodeError(f"the episode has ended ({self.end}): no model turn may follow")
        if len(token_ids) != len(logprobs):
            raise EpisodeError(f"{len(token_ids)} token ids but {len(logprobs)} log-probs")
        if not token_ids:
            raise EpisodeError("a model turn of no tokens")
        if len(token_ids) > self.room():
            raise EpisodeError(f"a model turn of {len(token_ids)} tokens; room for {self.room()}")
        versions = [version] * len(token_ids) if isinstance(version, int) else list(version)
        if len(versions) != len(token_ids):
            raise EpisodeError(f"{len(token_ids)} token ids but {len(versions)} versions")
        if min(versions) < 0:
            raise EpisodeError(f"weight version {min(versions)} < 0")
        self._current.append(
            [int(t) for t in token_ids],
            True,
            [float(x) for x in logprobs],
            [int(v) for v in versions],
        )
        self._current.turns += 1
        self.turns += 1
        text = self.turn_text(token_ids)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def add_environment(self, messages: Sequence[Message]) -> bool:
        """Add environment messages (tool results, a user turn) and the next generation prompt.

        Returns True when a model turn may follow; False when the episode ended instead (a
        budget: `end` says which, and the messages were not appended).
        """
        return self.add_conversation([*self.messages, *messages])

    def add_conversation(self, conversation: Sequence[Message]) -> bool:
        """`add_environment` for a caller that sends the whole conversation each time (an agent
        through the OpenAI endpoint), its earlier turns included: it replaces `messages`; the
        render is appended when it extends the tokens so far, else starts a new sample."""
        if self.finished:
            raise EpisodeError(f"the episode has ended ({self.end}): nothing may follow")
        self.messages = [dict(m) for m in conversation]
        rendered = self.render(self.messages)
        stop = budget_end(self.turns, self.max_turns, len(rendered), self.max_tokens)
        if stop is not None:
            spent = f"{self.turns} model turns, the next prompt {len(rendered)} tokens"
            self.finish(stop, f"{stop}: {spent}")
            return False
        so_far = self._current.tokens
        ext = extension(so_far, rendered)
        if ext.extends:
            self._current.append(rendered[ext.start :], False, [], [])
            return True
        reason = (
            f"the render differs from the {len(so_far)} tokens so far at token {ext.start} "
            f"({_at(so_far, ext.start)} became {_at(rendered, ext.start)})"
        )
        if self._current.turns:  # else nothing sampled in it yet: the new render replaces it
            self.samples.append(self._current.frozen("continued", reason))
        self._current = _Building(prompt=rendered)
        return True

    def finish(self, end: EpisodeEnd, reason: str = "") -> list[EpisodeSample]:
        """End the episode; returns all its samples (trailing environment tokens dropped; a last
        sample with no model turn is not kept)."""
        if self.finished:
            raise EpisodeError(f"the episode has ended already ({self.end})")
        self.end, self.reason = end, reason
        self._current.trim_environment()
        if self._current.turns:
            self.samples.append(self._current.frozen(end, reason))
        return self.samples


def _at(tokens: Sequence[int], i: int) -> str:
    return str(tokens[i]) if i < len(tokens) else "the end"
