"""The GPU check script: its CPU smoke mode runs every section's code path and reports each,
a section past its budget is killed and recorded while the next still runs, and (on a GPU
machine only) the engines section runs on CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = {"env", "engines", "fsdp", "megatron", "nccl", "weights", "pipeline", "external"}


def run_check(
    args: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    """Runs ops/gpu_check.py; returns (the last line parsed as JSON, the whole output)."""
    cmd = [sys.executable, str(ROOT / "ops" / "gpu_check.py"), *args]
    try:
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"gpu_check {' '.join(args)} did not finish in {timeout:.0f}s; output: "
            f"{str(exc.stdout)[-2000:]}"
        )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"gpu_check exited {done.returncode}: {output[-3000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"gpu_check printed nothing: {output[-3000:]}"
    try:
        report = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"last line is not JSON: {lines[-1][:500]!r}")
    return report, output


@pytest.mark.slow
def test_cpu_smoke_measures_every_section(tmp_path: Path) -> None:
    report, output = run_check(
        ["--cpu-smoke", "--json", str(tmp_path / "copy.json")],
        timeout=420,
        env={"OUT": str(tmp_path)},
    )
    sections = report["sections"]
    assert set(sections) == SECTIONS, f"sections reported: {sorted(sections)}"
    errors = {name: s["error"] for name, s in sections.items() if "error" in s}
    assert not errors, f"sections failed in the smoke run: {errors}\n{output[-3000:]}"
    for written in (tmp_path / "gpu_check.json", tmp_path / "copy.json"):  # $OUT's and --json's
        assert written.exists(), f"{written.name} was not written"
        assert json.loads(written.read_text()) == report, (
            f"{written.name} differs from the last line"
        )

    env = sections["env"]
    assert env["project_imports"]["ok"], env["project_imports"]
    assert env["nats_server"]["path"], "no nats-server found"
    assert set(env["optional_engines"]) == {
        "vllm",
        "sglang",
        "megatron.core",
        "flash_attn",
        "transformer_engine",
    }

    engines = sections["engines"]
    rollout = engines["rollout"]
    assert rollout["dtype"] == "bfloat16" and rollout["device"] == "cpu", rollout
    assert [r["batch"] for r in rollout["runs"]] == [2, 4], rollout
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in rollout["runs"]), rollout
    train = engines["train"]
    assert train["param_dtype"] == "float32", train
    for variant in ("float32", "tf32_matmul", "autocast_bf16"):
        assert train[variant]["tokens_per_s"] > 0 and train[variant]["loss_finite"], (
            variant,
            train,
        )

    fsdp = sections["fsdp"]
    assert fsdp["setup"]["world_size"] == 1 and fsdp["setup"]["backend"] == "gloo", fsdp
    tiny = fsdp["tiny"]
    assert tiny["train"]["tokens_per_s"] > 0 and tiny["train"]["loss_finite"], fsdp
    assert tiny["export"]["same_bytes"] and tiny["export"]["tensors"] > 0, fsdp
    assert tiny["export"]["bf16_mb"] * 2 == pytest.approx(tiny["export"]["mb"], abs=0.2), fsdp

    megatron = sections["megatron"]  # megatron-core is in the dev extra
    assert megatron["setup"]["tp"] == 1 and megatron["train"]["loss_finite"], megatron
    # on the CPU megatron's linear layers refuse autocast's bf16: the float32 figure stands in
    assert megatron["train"]["compute_dtype"] in ("bfloat16", "float32"), megatron
    assert sections["nccl"]["skipped"] == "needs CUDA, device is cpu", sections["nccl"]

    weights = sections["weights"]
    assert [r["mb"] for r in weights["runs"]] == [1, 4, 8], weights
    assert all(r["round_trip_exact"] for r in weights["runs"]), weights["runs"]
    assert weights["growth"]["get_version_exponent"] is not None, weights["growth"]

    summary = sections["pipeline"]["summary"]
    assert summary["steps"] == 4 and summary["samples_per_s"] > 0, summary

    external = sections["external"]  # vllm and sglang need CUDA: on the CPU it says why it skipped
    assert external["skipped"] in (
        "none of ('vllm', 'sglang') installed",
        "needs CUDA, device is cpu",
    ), external


def test_section_past_its_budget_is_killed_and_the_next_runs() -> None:
    # 1 s cannot hold the engines section (its imports alone take longer); weights must still run.
    report, output = run_check(
        ["--cpu-smoke", "--sections", "engines,weights", "--section-budget", "engines=1"],
        timeout=180,
    )
    sections = report["sections"]
    assert set(sections) == {"engines", "weights"}, sorted(sections)
    assert "killed at its budget" in sections["engines"].get("error", ""), sections["engines"]
    assert sections["engines"]["seconds"] < 5, (
        f"the section outlived its 1 s budget: {sections['engines']}"
    )
    assert "error" not in sections["weights"], f"{sections['weights']}\n{output[-3000:]}"
    assert all(r["round_trip_exact"] for r in sections["weights"]["runs"]), sections["weights"]


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"CUDA not available (torch {torch.__version__}): "
    "the engines section on a GPU needs one",
)
def test_engines_section_runs_on_cuda() -> None:
    report, output = run_check(["--tiny", "--device", "cuda", "--sections", "engines"], timeout=300)
    engines = report["sections"]["engines"]
    assert "error" not in engines, f"{engines}\n{output[-3000:]}"
    assert engines["rollout"]["device"] == "cuda" and engines["rollout"]["dtype"] == "bfloat16", (
        engines["rollout"]
    )
    assert all(r["peak_gib"] > 0 for r in engines["rollout"]["runs"]), engines["rollout"]
    assert (
        engines["train"]["param_dtype"] == "float32" and engines["train"]["float32"]["peak_gib"] > 0
    ), engines["train"]
