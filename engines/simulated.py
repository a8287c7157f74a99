"""A simulated rollout engine, for scheduling studies only: it learns nothing and means nothing.

It answers like a continuous-batching engine with `slots` concurrent sequences: each sample's
response length is drawn from a log-normal (a long tail, as reasoning workloads have), capped
at `max_tokens`, and costs `seconds_per_token` per token; a sample waits for the first free
slot, and `generate` returns when its last sample finishes (the batch's makespan).

It is also a `ContinuousEngine`: `generate_sample` runs one sample token by token (one
`seconds_per_token` sleep each), called from up to `slots` threads at once, each returning as
soon as its own sample ends; `pause` stops every sample between two tokens so that weights
load with no token being computed, and each token records the version it was computed with
(partial rollout).

It is also a `ReleasableEngine`, with a simulated device memory (`placement: colocated`):
it holds `memory_mib` on its device from the start; `release_memory` takes `sleep_seconds`
and leaves it holding 0, `resume_memory` takes `wake_seconds` and holds it again; generating
while released is an error (a phase that ran while the trainer held the device). The tokens
are random ids inside the model's vocabulary with log-prob -1.0, so the bus, reward, buffer
and trainer downstream run unchanged; the weights it is given are only counted (`version`).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engines.protocols import Sample, SamplingParams

LOGPROB = -1.0
"""The behaviour log-prob of every simulated token."""


@dataclass(frozen=True)
class SimulatedSettings:
    """What `rollout.engine` of type simulated says
    (`schemas.rollout_config.SimulatedRolloutConfig`)."""

    median_tokens: float = 64.0
    sigma: float = 1.0
    seconds_per_token: float = 0.001
    slots: int = 4
    seed: int = 0
    memory_mib: float = 0.0
    sleep_seconds: float = 0.0
    wake_seconds: float = 0.0


def draw_lengths(
    rng: np.random.Generator, count: int, median: float, sigma: float, cap: int
) -> np.ndarray:
    """[count] int64 response lengths: log-normal with `median` and `sigma` (of the log),
    in [1, cap]."""
    lengths = np.rint(rng.lognormal(np.log(median), sigma, count)).astype(np.int64)
    return np.clip(lengths, 1, cap)


def finish_times(durations: Sequence[float], slots: int) -> list[float]:
    """When each job ends, run in order on `slots` servers, each job on the first one free
    (what a continuous-batching engine does with requests queued beyond its slots)."""
    free = [0.0] * slots  # a heap of the times the slots come free
    ends = []
    for duration in durations:
        start = heapq.heappop(free)
        ends.append(start + duration)
        heapq.heappush(free, start + duration)
    return ends


class SimulatedRolloutEngine:
    """`RolloutEngine` that sleeps for the simulated time instead of computing.

    `model` is the run's real model, kept only for what the worker checks against it (its
    vocabulary, context and weight manifest); it never runs. Calls of `generate` from
    several threads share the slots one after the other (one engine, one set of slots);
    `generate_sample` is for up to `slots` threads at once, the caller keeping that count
    (`consumers.rollout_copies`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        vocab_size: int,
        eos_token_id: int,
        settings: SimulatedSettings,
    ) -> None:
        self.model, self.vocab_size, self.eos, self.settings = (
            model,
            vocab_size,
            eos_token_id,
            settings,
        )
        self.rng = np.random.default_rng(settings.seed)
        self.lock = threading.Lock()
        self.version = 0
        self.slots = settings.slots
        self.state = threading.Condition()
        """Guards `paused` and `computing`; notified when either changes."""
        self.paused = False
        self.computing = 0
        """Tokens being computed now, by all `generate_sample` threads."""
        self.released = False
        """Its device memory given back (`release_memory`): no generation until resumed."""

    def device_bytes(self) -> int:
        return 0 if self.released else int(self.settings.memory_mib * (1 << 20))

    def release_memory(self) -> None:
        with self.lock:
            if not self.released:
                time.sleep(self.settings.sleep_seconds)
                self.released = True

    def resume_memory(self) -> None:
        with self.lock:
            if self.released:
                time.sleep(self.settings.wake_seconds)
                self.released = False

    def check_held(self) -> None:
        """Refuse to compute on a device it gave back."""
        if self.released:
            raise RuntimeError("generation on a simulated engine whose memory is released")

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[Sample]]:
        s = self.settings
        with self.lock:
            self.check_held()
            started = time.perf_counter()
            lengths = draw_lengths(
                self.rng, len(prompts) * n, s.median_tokens, s.sigma, params.max_tokens
            )
            drawn = [self.sample(int(length), params.max_tokens) for length in lengths]
            ends = finish_times(
                [float(length) * s.seconds_per_token for length in lengths], s.slots
            )
            time.sleep(max(0.0, max(ends, default=0.0) - (time.perf_counter() - started)))
        return [drawn[i * n : (i + 1) * n] for i in range(len(prompts))]

    def generate_sample(self, prompt: Sequence[int], params: SamplingParams) -> Sample:
        with self.lock:  # the generator is not thread-safe
            self.check_held()
            length = int(
                draw_lengths(
                    self.rng, 1, self.settings.median_tokens, self.settings.sigma, params.max_tokens
                )[0]
            )
            drawn = self.sample(length, params.max_tokens)
        versions = torch.empty(length, dtype=torch.int32)  # [L]: who computed each token
        # Each token ends `seconds_per_token` after the last one (plus any pause): a sleep that
        # overshoots on a busy machine is taken back from the next token, as `generate` does
        # for its makespan, so a sample costs its length times the token time.
        due = time.perf_counter()
        for index in range(length):
            asked = time.perf_counter()
            versions[index] = self.start_token()
            due += self.settings.seconds_per_token + (
                time.perf_counter() - asked
            )  # paused time not charged
            try:
                self.compute_token(due)
            finally:
                self.end_token()
        return Sample(drawn.token_ids, drawn.logprobs, drawn.finish_reason, versions)

    def start_token(self) -> int:
        """Wait while paused, then count a token as computing; the version it is computed with."""
        with self.state:
            while self.paused:
                self.state.wait()
            self.computing += 1
            return self.version

    def compute_token(self, due: float) -> None:
        """One token's decode: the simulated time in a slot, until `due` (perf_counter)."""
        time.sleep(max(0.0, due - time.perf_counter()))

    def end_token(self) -> None:
        with self.state:
            self.computing -= 1
            self.state.notify_all()

    def pause(self) -> None:
        with self.state:
            self.paused = True
            while self.computing:
                self.state.wait()

    def resume(self) -> None:
        with self.state:
            self.paused = False
            self.state.notify_all()

    def sample(self, length: int, max_tokens: int) -> Sample:
        """`length` random ids other than eos; one that stopped before the cap ends with eos."""
        ids = self.rng.integers(0, self.vocab_size - 1, length)
        ids[ids >= self.eos] += 1  # skip eos: [0, vocab) without it
        stopped = length < max_tokens
        if stopped:
            ids[-1] = self.eos
        return Sample(
            torch.from_numpy(ids), torch.full((length,), LOGPROB), "stop" if stopped else "length"
        )

    def load_state_dict(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> None:
        """Takes the version only: nothing here runs the weights. Between generations, or
        between `pause` and `resume`: never while a token is being computed. A name the model
        does not have is refused (KeyError), as every engine refuses it."""
        unknown = sorted(set(tensors) - {name for name, _ in self.model.named_parameters()})
        if unknown:
            raise KeyError(f"weight names the model does not have: {unknown[:5]}")
        with self.state:
            if self.computing:
                raise RuntimeError(
                    f"weights loaded while {self.computing} tokens are being computed"
                )
            self.version = self.version + 1 if version is None else version
