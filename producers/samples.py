"""`samples.jsonl` in the run directory: what the model generated, every `report.samples_every`-th
group, one JSON line per group, written by the main job as the run goes.

    rewards stream (ByPosition, from its first stored message) -> the samples of each chosen
        group (prompt index % samples_every == 0), held until the group's outcome is known:
    trained   a step's metrics (`Producer.metrics`) list one of its sample ids -> that step, and
              the staleness of each response (step - the oldest version among its tokens)
    dropped   its `drop.<prompt id>` key (`Producer.dropped`) -> the drop's reason from KV
    -> one line (`group_line`): prompt text, each response's text, reward, failure reason,
       finish reason, tokens (of them the environment's: a multi-turn episode's tool results
       and turn headers, not trained), weight version (of its trained tokens) and staleness,
       the step; appended and flushed at once

Token ids are decoded with the run's own tokenizer (`model.path`: its directory, or the
tokenizer's files of a hub id), loaded in a thread at start; where it cannot be loaded the
prompt's ids are written instead and each response is the text the rollout decoded. A resumed
run reads the stream from its first stored message again and skips the groups the file has. A
group whose outcome is still unknown when the run ends is written as `pending`; when the job
is stopped it is left for the resume. `ops.samples` prints the file.

The rewards stream is read in full, not only the chosen groups: its one subject cannot be
filtered by prompt. Decoding each reward costs the producer's process tens of microseconds;
`samples_every: 0` turns the reader off. The stream deletes a message once every consumer has
it (interest retention), this reader's (ephemeral, no acks) among them: it keeps up, and the
server drops its consumer once the producer is gone. A stream the producer may not read (a
cluster's users.conf from before it did) leaves the run without samples, with a warning.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import nats.errors

from bus.readers import ByPosition, Poison
from bus.topology import REWARDS, drop_key
from producers.gate import Producer
from schemas import RewardEvent, Rewards, prompt_of
from schemas.config import RunConfig
from schemas.kv_records import DropRecord

log = logging.getLogger("jetrl.samples")
SAMPLES_FILE = "samples.jsonl"
MAX_HELD = 4096
"""Most chosen groups held while their outcome is unknown; past it the oldest is written as
pending (a buffer that never settles them must not grow the producer's memory)."""
Decode = Callable[[Sequence[int]], str]


def group_line(
    rewards: Sequence[RewardEvent],
    decode: Decode | None,
    *,
    step: int | None,
    dropped: str | None = None,
) -> dict[str, Any]:
    """One group's line: its prompt and its responses as text, with reward, failure, version and
    staleness each; `step` the step that trained it (None: not trained), `dropped` why the
    buffer dropped it."""
    ordered = sorted(rewards, key=lambda r: r.trajectory.sample_index)
    first = ordered[0].trajectory
    prompt_ids = [int(i) for i in first.prompt_ids.numpy()]
    responses = []
    for r in ordered:
        t = r.trajectory
        versions = t.trained_versions()
        version = int(versions.min()) if versions.size else None
        ids = [int(i) for i in t.response_ids.numpy()]
        trained = t.trained_mask()
        responses.append(
            {
                "index": t.sample_index,
                "text": decode(ids) if decode is not None else t.response_text,
                "reward": r.reward,
                "failed": r.reason if r.failed else None,
                "finish": t.finish_reason,
                "tokens": len(ids),
                # An episode's tool results and turn headers: in `tokens`, never trained.
                "environment_tokens": int(len(ids) - trained.sum()),
                # An agent episode split where its template stopped extending its tokens: its
                # samples, each trained (`text` and `tokens` are its last one's).
                "segments": len(t.earlier) + 1,
                "version": version,
                "staleness": None if step is None or version is None else step - version,
            }
        )
    oldest = [v for r in responses if isinstance(v := r["version"], int)]
    version = min(oldest) if oldest else None
    return {
        "prompt_id": first.prompt_id,
        "step": step,
        "outcome": (
            "trained" if step is not None else "dropped" if dropped is not None else "pending"
        ),
        "dropped": dropped,
        "prompt": decode(prompt_ids) if decode is not None else None,
        "prompt_ids": None if decode is not None else prompt_ids,
        "group_size": first.group_size,
        "version": version,
        "staleness": None if step is None or version is None else step - version,
        "reward_mean": sum(r.reward for r in ordered) / len(ordered),
        "responses": responses,
    }


def written_groups(path: Path) -> set[str]:
    """The prompt ids a samples file already has (a resumed run does not write them again)."""
    if not path.exists():
        return set()
    ids = set()
    for line in path.read_text().splitlines():
        try:
            ids.add(json.loads(line)["prompt_id"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return ids


def load_decoder(cfg: RunConfig) -> Decode | None:
    """The run's tokenizer's decode (special tokens kept: what the model saw and said); None,
    with a warning, where the tokenizer cannot be loaded here. A hub id fetches the tokenizer's
    files only, not the model's weights (the producer's node may have no room for them); a
    `.gguf` file is read from its conversion (`engines.gguf`, the one the workers load)."""
    path = cfg.model.path
    try:
        if not path:
            raise ValueError("model.path is not set")
        # Imported here: transformers takes seconds, and a run without samples never needs it.
        from transformers import AutoTokenizer

        if str(path).endswith(".gguf"):  # its conversion (cached per node) holds the tokenizer
            from engines.model_source import resolve_model_path

            path = str(resolve_model_path(path))
        local = Path(path).expanduser().is_dir()
        tokenizer = AutoTokenizer.from_pretrained(
            path, revision=None if local else cfg.model.revision
        )
    except Exception as exc:  # noqa: BLE001 - any failure: fall back to ids, say why once
        log.warning("samples: the run's tokenizer cannot be loaded here (%s): ids written", exc)
        return None
    return lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=False))


class SamplesWriter:
    """Follows the rewards stream for `Producer`, writing each chosen group once its outcome is
    known (`follow`); `flush` writes what is settled, and at the end what is not."""

    def __init__(self, producer: Producer, out: Path) -> None:
        self.producer, self.cfg = producer, producer.cfg
        self.every = self.cfg.report.samples_every
        self.path = out / SAMPLES_FILE
        self.done = written_groups(self.path)
        self.held: dict[str, dict[int, RewardEvent]] = {}
        """Chosen prompt id -> its samples so far, by sample index."""
        self.seen_steps: set[int] = set()
        self.trained: dict[str, int] = {}
        """Chosen prompt id -> the step that trained it."""
        self.known = (0, 0)
        """(steps, drops) the producer had at the last settle."""
        self.decode: Decode | None = None

    async def follow(self, every: float = 1.0) -> None:
        """Read the rewards stream for ever; settle held groups every `every` seconds."""
        if self.every <= 0:
            return
        self.decode = await asyncio.to_thread(load_decoder, self.cfg)
        rt = self.producer.rt
        reader: ByPosition[Rewards] = ByPosition(
            rt.js,
            rt.topology,
            REWARDS,
            Poison("producer samples"),
            start_seq=1,
            wanted=lambda event_id: self.wants(prompt_of(event_id)),
        )
        try:
            await reader.open()
        except (nats.errors.Error, TimeoutError) as exc:
            # A cluster's users.conf from before the producer read rewards refuses the consumer:
            # the run goes on without its samples.
            log.warning("samples.jsonl not written: the rewards stream cannot be read (%r)", exc)
            return
        try:
            while True:
                try:
                    stored = await reader.next(timeout=every)
                except TimeoutError:
                    await self.settle()
                    continue
                for reward in stored.event.each():  # a sample's event, or its group's
                    self.take(reward)
                if len(self.held) > MAX_HELD:
                    oldest = next(iter(self.held))
                    self.write(oldest, step=None)
                await self.settle(quick=True)
        finally:
            await reader.close()

    def wants(self, prompt_id: str) -> bool:
        """Whether the group of `prompt_id` is a chosen one not written yet."""
        return prompt_id not in self.done and self.cfg.report.samples(prompt_id)

    def take(self, reward: RewardEvent) -> None:
        """Hold `reward` if its group is a chosen one not written yet."""
        pid = reward.trajectory.prompt_id
        if not self.wants(pid):
            return
        self.held.setdefault(pid, {})[reward.trajectory.sample_index] = reward

    def note_steps(self) -> None:
        """Chosen prompt id -> the step that trained it, from the steps not looked at before
        (kept for groups not read yet: the reader may lag behind the trainer)."""
        for step, m in sorted(self.producer.metrics.items()):
            if step in self.seen_steps:
                continue
            self.seen_steps.add(step)
            for sid in m.get("sample_ids", []):
                pid = prompt_of(sid)
                if pid not in self.done and self.cfg.report.samples(pid):
                    self.trained[pid] = step

    async def settle(self, quick: bool = False) -> None:
        """Write the held groups whose outcome is known: trained (once every sample is read) or
        dropped. `quick`: only when a step or a drop came since the last time."""
        known = (len(self.producer.metrics), len(self.producer.dropped))
        if quick and known == self.known:
            return
        self.known = known
        self.note_steps()
        for pid, samples in list(self.held.items()):
            step = self.trained.get(pid)
            size = next(iter(samples.values())).trajectory.group_size
            if step is not None and len(samples) == size:
                self.write(pid, step=step)
            elif step is None and drop_key(pid) in self.producer.dropped:
                try:
                    entry = await self.producer.rt.kv.get(drop_key(pid))
                    reason = DropRecord.decode(entry.value).reason
                except Exception as exc:  # noqa: BLE001 - a display must not stop the run
                    reason = f"(reason unreadable now: {exc!r})"
                self.write(pid, step=None, dropped=reason or "(no reason recorded)")

    def flush(self, pending: bool = True) -> None:
        """At the job's end: every group still held that a step trained; with `pending` (the run
        is over) the others as pending. A stopped run leaves them out: its resume reads their
        samples again (the buffer had not acked them) and writes them once settled."""
        self.note_steps()
        for pid in list(self.held):
            if pid in self.trained or pending:
                self.write(pid, step=self.trained.get(pid))

    def write(self, pid: str, *, step: int | None, dropped: str | None = None) -> None:
        rewards = self.held.pop(pid, {})
        if not rewards or pid in self.done:
            return
        line = group_line(list(rewards.values()), self.decode, step=step, dropped=dropped)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        self.done.add(pid)
        self.trained.pop(pid, None)
