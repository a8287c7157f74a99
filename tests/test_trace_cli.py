"""One prompt's life is one trace, and `ops.trace` prints it from Jaeger's query API.

A real 3-step run (producer, embedded nats-server, local fleet of real workers) exports its
spans and metrics over OTLP/HTTP to a stdlib server standing in for Jaeger
(`tests.fake_jaeger`), which answers Jaeger's query API. One batched sample's trace must
hold every stage, in the right parent-child order, and link to the train step that took
its samples and the weight version that step produced.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ops.trace import Jaeger, SpanView, find, linked, timeline
from tests.fake_jaeger import FakeJaeger

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


@pytest.fixture(scope="module")
def jaeger() -> Iterator[FakeJaeger]:
    with FakeJaeger() as server:
        yield server


@pytest.fixture(scope="module")
def traced_run(jaeger: FakeJaeger, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Run a small job with every process exporting to `jaeger`; return the run id."""
    tmp = tmp_path_factory.mktemp("traced-run")
    run = f"tc{uuid.uuid4().hex[:8]}"
    config = {
        "run": run,
        "model": {"hidden": 32, "layers": 1},
        "data": {"n": 4, "sampling": {"max_tokens": 6}},
        "algorithm": {"prompts_per_step": 2},
        "reward": {"processes": 1},
    }
    (tmp / "run.yaml").write_text(yaml.safe_dump(config))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
        "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.url,
        "OTEL_BSP_SCHEDULE_DELAY": "200",  # export spans every 0.2 s, not 5 s
    }
    subprocess.run(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--config",
            str(tmp / "run.yaml"),
            "--steps",
            str(STEPS),
            "--out",
            str(tmp / "out"),
        ],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=120,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return run


def batched_prompt(jaeger: FakeJaeger, run: str) -> str:
    """The prompt id of a sample the buffer put into a step."""
    for span, _ in jaeger.spans:
        tags = {t["key"]: t["value"] for t in span["tags"]}
        if (
            span["operationName"] == "outcome"
            and tags.get("jetrl.batched") is True
            and tags["jetrl.run"] == run
        ):
            return str(tags["jetrl.prompt_id"])
    raise AssertionError("no batched sample in the exported spans")


def one(spans: list[SpanView], name: str) -> SpanView:
    (span,) = [s for s in spans if s.name == name]
    return span


def test_one_prompt_is_one_trace_linked_to_its_train_step(
    jaeger: FakeJaeger, traced_run: str
) -> None:
    run = traced_run
    prompt_id = batched_prompt(jaeger, run)
    client = Jaeger(jaeger.url)
    (spans,) = find(client, prompt_id)
    by_id = {s.span_id: s for s in spans}

    def parent(span: SpanView) -> SpanView:
        assert span.parent is not None, span.name
        return by_id[span.parent]

    # producer -> rollout: the prompt's publish, and the rollout's process span under it.
    root = one(spans, "prompt")
    assert (
        root.parent is None
        and root.service == "jetrl-producer"
        and root.tags["jetrl.prompt_id"] == prompt_id
    )
    send_prompt = one(spans, f"send rl.{run}.prompts")
    assert parent(send_prompt) == root
    process_prompt = one(spans, f"process rl.{run}.prompts")
    assert parent(process_prompt) == send_prompt and process_prompt.service == "jetrl-rollout"
    generate = one(spans, "generate")
    assert parent(generate) == process_prompt
    assert generate.tags["jetrl.prompt_id"] == prompt_id and generate.tags["jetrl.engine"] == "hf"
    assert generate.tags["jetrl.tokens"] > 0 and isinstance(
        generate.tags["jetrl.policy_version"], int
    )
    assert generate.tags["jetrl.worker"] == generate.worker and generate.worker.endswith(":rollout")

    # The group's n trajectories -> its n rewards -> n admissions: the trajectories travel as one
    # event and the rewards as one (`schemas.group_events`), each hop chained through the
    # message headers; the rollout and the reward worker publish inside their process spans.
    outcomes = [s for s in spans if s.name == "outcome"]
    assert len(outcomes) == 4
    (send_reward_id,) = {parent(o).span_id for o in outcomes}
    send_reward = by_id[send_reward_id]
    assert send_reward.name == f"send rl.{run}.rewards"
    process_trajectory = parent(send_reward)
    assert process_trajectory.name == f"process rl.{run}.trajectories"
    assert process_trajectory.service == "jetrl-reward"
    assert parent(parent(process_trajectory)) == process_prompt  # via its send span
    rewards = [s for s in spans if s.name == "reward" and s.parent == process_trajectory.span_id]
    assert sorted(r.tags["jetrl.sample_index"] for r in rewards) == [0, 1, 2, 3]
    for reward in rewards:
        assert reward.tags["jetrl.failed"] is False and 0.0 <= reward.tags["jetrl.reward"] <= 1.0
    buffer_process = [
        s for s in spans if s.parent == send_reward.span_id and s.name.startswith("process")
    ]
    assert [s.service for s in buffer_process] == ["jetrl-buffer"]
    for outcome in outcomes:
        assert outcome.tags["jetrl.batched"] is True and outcome.service == "jetrl-buffer"
    (step,) = {a.tags["jetrl.step"] for a in outcomes}  # a group goes into one step

    # The step's spans live in traces of their own and link to every admission of ours.
    others = linked(client, spans)
    outcome_ids = {a.span_id for a in outcomes}
    assemble = one(others, "assemble batch")
    train = one(others, "train step")
    for span in (assemble, train):
        assert span.trace_id != root.trace_id and span.tags["jetrl.step"] == step
        assert outcome_ids <= {span_id for _, span_id in span.links}
    assert train.tags["jetrl.weight_version"] == step + 1
    publish = one(others, "publish weights")
    assert publish.parent == train.span_id and publish.tags["jetrl.weight_version"] == step + 1


def test_ops_trace_prints_the_timeline(jaeger: FakeJaeger, traced_run: str) -> None:
    prompt_id = batched_prompt(jaeger, traced_run)
    out = subprocess.run(
        [sys.executable, "-m", "ops.trace", prompt_id, "--jaeger", jaeger.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    print(out)  # pytest -s shows the timeline
    lines = out.splitlines()
    assert lines[0].startswith("trace ") and f"prompt {prompt_id} (run {traced_run})" in lines[0]
    names = [
        line.split()[2] for line in lines[2:]
    ]  # offset, duration, then the (indented) span name
    assert names[:4] == ["prompt", "send", "process", "generate"]
    assert (
        sum(
            name == "outcome" and "step " in line
            for name, line in zip(names, lines[2:], strict=True)
        )
        == 4
    )
    assert (
        sum(
            name == "reward" and ", reward " in line
            for name, line in zip(names, lines[2:], strict=True)
        )
        == 4
    )
    link_at = lines.index("linked from other traces (the steps that took this prompt's samples):")
    linked_text = "\n".join(lines[link_at + 1 :])
    train = re.search(
        r"train step\s+\S+\s+v(\d+)\s+step (\d+), links 4 of these samples", linked_text
    )
    assert train is not None, linked_text
    assert int(train[1]) == int(train[2]) + 1
    assert re.search(rf"publish weights\s+\S+\s+v{train[1]}\b", linked_text), linked_text

    by_trace_id = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.trace",
            lines[0].split()[1].rstrip(":"),
            "--jaeger",
            jaeger.url,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert by_trace_id == out


def test_ops_trace_says_when_there_is_no_trace(jaeger: FakeJaeger) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ops.trace", "nosuchrun/0/0", "--jaeger", jaeger.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1 and result.stderr.startswith(
        "ops.trace: no trace for nosuchrun/0/0"
    )


def test_workers_export_metrics_over_otlp(jaeger: FakeJaeger, traced_run: str) -> None:
    # Each process flushes its metrics when it exits: the run is over, so all are in.
    assert {
        "jetrl.samples",
        "jetrl.prompts",
        "jetrl.generate.duration",
        "jetrl.train_step.duration",
        "jetrl.reward",
        "jetrl.staleness",
        "jetrl.queue.depth",
    } <= set(jaeger.metric_points)


def test_an_agent_episode_reads_turn_by_turn() -> None:
    """The spans a rollout worker makes for an episode (`consumers.episodes`), as ops.trace
    prints them: the episode (turns, how it ended, takeovers), each turn, each tool call."""

    def span(span_id: str, name: str, parent: str | None, start: int, **tags: Any) -> SpanView:
        return SpanView(
            "t" * 32, span_id, name, "jetrl-rollout", "rollout-0", start, 1000, tags, parent, ()
        )

    spans = [
        span("1", "prompt", None, 0, **{"jetrl.prompt_id": "r/0/0", "jetrl.run": "r"}),
        span(
            "2",
            "episode",
            "1",
            10,
            **{"jetrl.sample_index": 1, "jetrl.turns": 2, "jetrl.end": "done", "jetrl.resumed": 1},
        ),
        span("3", "turn", "2", 20, **{"jetrl.turn": 0, "jetrl.tokens_added": 12}),
        span("4", "tool call", "2", 30, **{"jetrl.tool": "add", "jetrl.ok": False}),
        span("5", "turn", "2", 40, **{"jetrl.turn": 1, "jetrl.tokens_added": 7}),
    ]
    lines = timeline(spans, []).splitlines()
    episode = next(line for line in lines if "episode" in line)
    assert "sample 1, 2 turns, ended done, resumed 1x" in episode
    turns = [line for line in lines if " turn " in f" {line} " and "+" in line]
    assert [t.split("turn ")[-1] for t in turns] == ["0: +12 tokens", "1: +7 tokens"]
    assert any("tool add FAILED" in line for line in lines)
