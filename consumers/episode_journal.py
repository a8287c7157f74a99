"""Durable episodes: each agent episode's state in the run's KV after every completed turn.

    EpisodeRunner.run(prompt, i)
        journal.recall(prompt.id, i) -> EpisodeState?   another worker took this prompt and died
            yes -> the episode resumes from it: the same tokens, the next turn
        ... each turn, once its environment part is appended -> journal.record(...)
        ... the end -> journal.record(...)   (a resumed finished episode is only re-stored)
    Rollout.handle_episodes: every trajectory of the prompt stored -> journal.forget(...)
        -> the prompt is acked

Why the KV (`episode.<prompt id>.<sample>`, `bus.channels.EPISODES`) and not a stream of turns:
a resume needs the last state of one episode, which is what a KV key holds (history 1),
read by key with no consumer, and deleted with the prompt. A worker killed mid-episode (kill
-9, a lost node) costs at most the turn in progress: its prompt comes back to another worker
within the work queue's ack_wait (10 s), which resumes each episode where it was recorded.
Its trajectories keep their ids (`<prompt id>/<sample>`), so one the dead worker had stored
already is deduplicated by the stream and trained once.

What does not survive a worker: an episode's tool process and its working directory (a tool
that keeps files between calls finds them gone after a resume); the turn in progress, and a
tool call in flight, run again.
"""

from __future__ import annotations

import contextlib
import logging

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from bus.topology import episode_key
from schemas.episode_state import EpisodeProgress, EpisodeState, TokensState

log = logging.getLogger("jetrl.episodes")


class EpisodeJournal:
    """The KV side of durable episodes, for one rollout worker."""

    def __init__(self, kv: KeyValue, worker: str) -> None:
        self.kv, self.worker = kv, worker

    async def recall(self, prompt_id: str, sample: int) -> EpisodeState | None:
        """The episode's last recorded state, or None (never recorded, or unreadable: logged,
        and the episode starts afresh)."""
        key = episode_key(prompt_id, sample)
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:  # and KeyDeletedError, its subclass
            return None
        if not entry.value:
            return None
        try:
            return EpisodeState.decode(entry.value)
        except ValueError as exc:
            reason = str(exc).splitlines()[0]
            log.warning("%s: an unreadable state (%s); the episode starts afresh", key, reason)
            return None

    async def record(
        self, prompt_id: str, sample: int, tokens: TokensState, progress: EpisodeProgress
    ) -> None:
        state = EpisodeState(
            tokens=tokens, progress=progress.model_copy(deep=True), worker=self.worker
        )
        await self.kv.put(episode_key(prompt_id, sample), state.encode())

    async def forget(self, prompt_id: str, samples: int) -> None:
        """Delete the states of a prompt's episodes (its trajectories are stored)."""
        for sample in range(samples):
            with contextlib.suppress(KeyNotFoundError):
                await self.kv.delete(episode_key(prompt_id, sample))
