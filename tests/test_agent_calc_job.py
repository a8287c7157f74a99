"""examples/agent_calc.yaml through the whole main job (embedded server, local fleet, the
calculator in its sandboxed tool process), a few steps from random init.

Each trained sample is one episode: its response carries the tool runner's answers to the
model's tool-call text (a random policy writes ``<tool_call>`` often and a well-formed call
almost never, so the answers are the parser's reasons, which the model reads like any result)
as environment tokens, never trained; the step metrics carry the episodes' tool-use rate and
turns. That a trained policy calls the calculator itself is `ops.bench.agent`'s to show
(docs/agents.md), that a well-formed call runs the tool and its result goes on the
conversation is tests/test_episode_rollout.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.overrides import read_yaml
from tests.helpers import ROOT, run_local_job

pytestmark = pytest.mark.slow  # the main job from start to end: a minute or more on 2 cores

STEPS = 3
TOOL_TURN = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"


def test_the_example_trains_episodes_with_tool_turns_through_the_main_job(
    tmp_path: Path,
) -> None:
    config = read_yaml(ROOT / "examples" / "agent_calc.yaml")
    assert isinstance(config, dict)
    # Every group's text; no regenerating groups of equal rewards (at random init nearly all
    # are 0, and the example regenerates up to 10 steps' worth a step: minutes on 2 cores).
    algorithm = {**config["algorithm"], "prompts_per_step": 4, "drop_equal_reward_groups": False}
    # From random init, as said above: the example's warm start (300 SFT steps) is
    # tests/test_warm_start.py's.
    model = {**config["model"], "warm_start": None}
    config = {**config, "run": "calc-job", "report": {"samples_every": 1}, "algorithm": algorithm}
    config["model"] = model
    job = run_local_job(config, tmp_path, STEPS, timeout=300)
    metrics = job.merged_metrics()
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        assert {"tool_use_rate", "turns_mean", "solved_rate"} <= set(m), m
        assert 0.0 <= m["tool_use_rate"] <= 1.0 and 1.0 <= m["turns_mean"] <= 3.0, m
        solved = m["solved_rate"]  # solved: through a call
        assert isinstance(solved, float) and 0.0 <= solved <= m["tool_use_rate"], m
    # Some episode went past its first turn: the tool runner answered a call, a turn followed.
    assert any(m["turns_mean"] > 1.0 for m in metrics), metrics
    groups = [json.loads(line) for line in (job.out / "samples.jsonl").read_text().splitlines()]
    trained = [r for g in groups if g["outcome"] == "trained" for r in g["responses"]]
    assert trained
    # The tool's turn as the template renders it (the model may write the tags itself too).
    answered = [r for r in trained if TOOL_TURN in r["text"]]
    assert answered, [r["text"] for r in trained]
    for r in answered:  # the answer and the next turn's header are the environment's, untrained
        assert 0 < r["environment_tokens"] < r["tokens"], r
    for r in trained:
        if TOOL_TURN not in r["text"]:  # one turn: every token the model's
            assert r["environment_tokens"] == 0, r
