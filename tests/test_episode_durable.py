"""Durable episodes (issue 27): a rollout worker killed mid-episode costs at most its turn.

A real rollout worker process (`tests.episode_script`: the production stage over a scripted
model, real tool processes) takes a prompt of GROUP episodes -- an answer, the environment's
"Are you sure?", a tool call, its result, a final answer -- and kills itself (SIGKILL, as
kill -9) at a named crash point: between two turns (`rollout.between_turns`, just after a turn
is recorded) or inside a tool call (`rollout.mid_tool_call`). Then another worker process
starts. At default settings (the work queue's ack_wait of 10 s returns the prompt to it):

- every episode the dead worker had recorded resumes from its recorded turn: its final
  trajectory begins with exactly the recorded tokens, and says it was resumed once;
- the trajectories are the whole conversation rendered once (token-exact), GROUP of them,
  one per episode, and no more arrive later: each episode is trained exactly once;
- once they are stored, the episodes' states are gone from the KV.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue
from transformers import AutoModelForCausalLM

from bus.connection import connect
from bus.crashpoints import CRASH_AT, CRASH_RECORD, FAIL_AT, arm
from bus.embedded import EmbeddedNats
from bus.runtime import publish_config
from bus.topology import PROMPTS, TRAJECTORIES, WEIGHTS, Topology, episode_key
from engines.tools import load_tools
from schemas import TrajectoryEvent, encode
from schemas.config import RunConfig
from schemas.episode_state import EpisodeState
from tests.episode_script import ADD, DURABLE, SCRIPT, build_chat_model, question
from tests.helpers import store_weights, stored_trajectories
from tests.test_stage import exited

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GROUP = 2


def worker(topology: Topology, url: str, **env: str) -> subprocess.Popen[str]:
    clean = {k: v for k, v in os.environ.items() if k not in (CRASH_AT, CRASH_RECORD, FAIL_AT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.episode_script", "--run", topology.run, "--nats", url],
        cwd=ROOT,
        env={**clean, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def recorded(kv: KeyValue, prompt_id: str) -> dict[int, EpisodeState]:
    states = {}
    for sample in range(GROUP):
        try:
            entry = await kv.get(episode_key(prompt_id, sample))
        except KeyNotFoundError:
            continue
        if entry.value:
            states[sample] = EpisodeState.decode(entry.value)
    return states


@pytest.mark.parametrize("point", ["rollout.between_turns", "rollout.mid_tool_call"])
def test_a_killed_workers_episodes_resume_on_another_from_their_last_turn(
    point: str, nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    model_dir, tokenizer = build_chat_model(tmp_path / "model")
    params = dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters())

    async def main() -> tuple[dict[int, EpisodeState], list[TrajectoryEvent], dict[int, object]]:
        nc = await connect(nats_server.url, "test-durable")
        js = nc.jetstream()
        await topology.apply(js)
        kv = await js.key_value(topology.kv_bucket)
        config = RunConfig.model_validate(
            {
                "run": topology.run,
                "model": {"path": str(model_dir)},
                "data": {"n": GROUP},
                "agent": {"environment": "tests.agent_tools:AskAgain", "tools": [ADD]},
            }
        )
        await publish_config(kv, config)
        event = await store_weights(js, topology, 0, {k: v.detach() for k, v in params.items()})
        await js.publish(topology.subject(WEIGHTS), encode(event))
        prompt = question(topology.run, 0, DURABLE, GROUP)
        await js.publish(topology.subject(PROMPTS), encode(prompt))

        first = worker(topology, nats_server.url, **{CRASH_AT: arm(f"{point}@1")})
        code, _ = await asyncio.to_thread(exited, first, 120, "the armed worker")
        assert code == -signal.SIGKILL, f"the armed worker exited {code}, not killed at {point}"
        before = await recorded(kv, prompt.id)
        stream = topology.stream(TRAJECTORIES)
        assert (await js.stream_info(stream)).state.messages == 0  # it died mid-episode

        second = worker(topology, nats_server.url)
        try:
            assert second.poll() is None, f"the second worker exited {second.returncode}"
            await stored_trajectories(js, topology, GROUP, timeout=90)
            await asyncio.sleep(3)  # time enough for a duplicate to arrive, were one sent
            stored = await stored_trajectories(js, topology, GROUP)
            after = await recorded(kv, prompt.id)
        finally:
            second.send_signal(signal.SIGTERM)
            await asyncio.to_thread(exited, second, 30, "the second worker")
            await topology.delete(js)
            await nc.close()
        return before, stored, dict(after)

    before, stored, after = asyncio.run(main())
    # The dead worker had recorded at least the episode whose turn or tool call it died in.
    assert before, f"no episode was recorded before the kill at {point}"
    assert all(state.tokens.turns >= 1 and state.tokens.end is None for state in before.values())
    # Each episode trained exactly once: one trajectory per sample, no duplicate.
    assert sorted(t.sample_index for t in stored) == list(range(GROUP))
    assert after == {}, "the states outlived the stored trajectories"
    turns = SCRIPT[DURABLE]
    schemas = [tool.schema for tool in load_tools([ADD]).values()]
    conversation = [
        {"role": "user", "content": DURABLE},
        {"role": "assistant", "content": turns[0]},
        {"role": "user", "content": "Are you sure?"},
        {"role": "assistant", "content": turns[1]},
        {"role": "tool", "name": "add", "content": "42"},
        {"role": "assistant", "content": turns[2]},
    ]
    once = tokenizer.apply_chat_template(
        conversation, tools=[*schemas], tokenize=True, return_dict=False
    )
    assert isinstance(once, list)
    once = [int(i) for i in once if isinstance(i, int)]
    for t in stored:
        episode = t.task["episode"]
        assert (t.finish_reason, episode["end"], episode["turns"]) == ("stop", "done", 3)
        assert episode["tool_calls"] == 1 and episode["reward"] == 1.0
        built = [*t.prompt_ids.numpy().tolist(), *t.response_ids.numpy().tolist()]
        assert built == once[: len(built)] and tokenizer.decode(once[len(built) :]) == "\n"
        mask = t.response_mask.numpy() if t.response_mask is not None else None
        assert mask is not None and int(mask.sum()) == sum(
            len(tokenizer.encode(text, add_special_tokens=False)) + 1 for text in turns
        )
        state = before.get(t.sample_index)
        if state is None:  # not recorded before the kill: it started afresh
            assert episode["resumed"] == 0
            continue
        # Resumed from its recorded turn, with its earlier tokens identical.
        assert episode["resumed"] == 1
        so_far = [*state.tokens.current.prompt, *state.tokens.current.response]
        assert built[: len(so_far)] == so_far
        assert len(built) > len(so_far)
