"""`ops.export` round-trips at every engine: the HF directory it writes from a trainer checkpoint
loads with transformers and computes what the trainer engine computed at that checkpoint.

Each run directory is made as the main job leaves one (`tests/export_proc.py`): the tiny model
(with a chat template) in RUN/model, two optimizer steps, the engine's checkpoint of step 2 in
RUN/checkpoints, and the engine's own log-probs there (RUN/expected.pt) of a fixed batch whose
rows cover every vocabulary token (so the whole output distribution is compared at one
position). The engines: torch (in this process), fsdp on two gloo ranks, megatron at tensor
parallel 2 (untied embeddings: the output layer's vocabulary cut too) and at pipeline parallel 2
on two gloo ranks (skipped without megatron-core). The exported model's log-probs must equal the
engine's to float tolerance, and differ from the untrained model's (an export of the base
weights fails). Then the tokenizer and chat template, the bfloat16 option, the run id
resolution and the one-line refusals.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.export import find_checkpoint
from engines.torch_train import TorchTrainEngine
from ops import export as ops_export
from tests.export_proc import ARGS, CHAT_TEMPLATE, STEPS, build_model, probe, train_and_save

ROOT = Path(__file__).parent.parent
TOLERANCE = 1e-5
"""float32: the engines' log-probs and the exported model's (megatron's attention and MLP
are other kernels: ~1e-6 apart)."""


def has_megatron() -> bool:
    return (
        importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None
    )


def made_by_proc(engine: str, run: Path) -> Path:
    """`tests/export_proc.py ENGINE RUN` in its own process (it spawns the ranks)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.export_proc", engine, str(run)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Engine -> a run directory with its checkpoint of step 2, made on first use."""
    root = tmp_path_factory.mktemp("export-runs")

    class Runs(dict[str, Path]):
        def __missing__(self, engine: str) -> Path:
            run = root / engine
            if engine == "torch":
                build_model(run / "model")
                train_and_save(TorchTrainEngine(run / "model", **ARGS), run, 0, "rank0.pt", rows=0)
            else:
                if engine.startswith("megatron") and not has_megatron():
                    pytest.skip("megatron-core is not installed (pip install 'jetrl[megatron]')")
                made_by_proc(engine, run)
            self[engine] = run
            return run

    return Runs()


def export(*argv: str) -> tuple[int, str]:
    """`python -m ops.export ARGV` in this process: its exit code and stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = ops_export.main(list(argv))
    return code, err.getvalue()


def logprobs(model_dir: Path) -> torch.Tensor:
    """[B, T] log-probs of `probe()`'s tokens under the HF model in `model_dir` (0 at t = 0),
    as the engines give them."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids, attention = probe()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    taken = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(taken, (1, 0))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["torch", "fsdp", "megatron-tp2", "megatron-pp2"])
def test_the_export_loads_and_computes_what_the_engine_did_at_the_step(
    engine: str, runs: dict[str, Path], tmp_path: Path
) -> None:
    run = runs[engine]
    expected = torch.load(run / "expected.pt", weights_only=True)
    assert expected["step"] == STEPS
    # The engine recorded the model it loaded, and the export takes the config from there.
    assert find_checkpoint(run / "checkpoints").model_dir == (run / "model").resolve()
    code, err = export("--run", str(run), "--step", str(STEPS), str(tmp_path / "hf"))
    assert code == 0, err
    assert f"model config and tokenizer from {(run / 'model').resolve()}" in err
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= files, files
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    got = logprobs(tmp_path / "hf")
    worst = (got - expected["logprobs"]).abs().max().item()
    assert worst < TOLERANCE, f"{engine}: exported log-probs differ by {worst:.3g}"
    # The trained weights, not the model the run started from.
    moved = (logprobs(run / "model") - expected["logprobs"]).abs().max().item()
    assert moved > 1e-2, f"{engine}: two steps moved the log-probs by {moved:.3g} only"


def test_the_tokenizer_and_chat_template_round_trip(runs: dict[str, Path], tmp_path: Path) -> None:
    run = runs["torch"]
    assert export("--run", str(run), str(tmp_path / "hf"))[0] == 0
    theirs = AutoTokenizer.from_pretrained(run / "model")
    ours = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours("c3149=")["input_ids"] == theirs("c3149=")["input_ids"]
    assert (ours.eos_token, ours.pad_token) == (theirs.eos_token, theirs.pad_token)
    assert ours.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "c31"}, {"role": "assistant", "content": "49"}]
    rendered = ours.apply_chat_template(chat, tokenize=False)
    assert rendered == theirs.apply_chat_template(chat, tokenize=False) == "c31=49="


def test_bfloat16_halves_the_weights_and_stays_close(runs: dict[str, Path], tmp_path: Path) -> None:
    run = runs["torch"]
    assert export("--run", str(run), str(tmp_path / "f32"))[0] == 0
    code, err = export("--run", str(run), "--dtype", "bfloat16", str(tmp_path / "bf16"))
    assert code == 0, err
    sizes = [(tmp_path / d / "model.safetensors").stat().st_size for d in ("f32", "bf16")]
    assert 0.45 < sizes[1] / sizes[0] < 0.55, sizes
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    expected = torch.load(run / "expected.pt", weights_only=True)["logprobs"]
    assert (logprobs(tmp_path / "bf16") - expected).abs().max().item() < 0.1


def test_a_step_not_on_disk_is_one_line_naming_the_step_there(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    code, err = export("--run", str(runs["torch"]), "--step", "5", str(tmp_path / "hf"))
    assert code == 1
    assert err.count("\n") == 1, err
    assert f"step 5 is not on disk: steps there: {STEPS}" in err
    assert not (tmp_path / "hf").exists()


def test_a_missing_run_and_a_run_without_checkpoints_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, err = export("--run", "nowhere", "hf")
    assert (code, err.count("\n")) == (1, 1), err
    assert "--run nowhere: no run directory" in err
    # The module as users run it: exit 1, the one line on stderr.
    done = subprocess.run(
        [sys.executable, "-m", "ops.export", "--run", "nowhere", "hf"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert (done.returncode, done.stderr.count("\n")) == (1, 1), done.stderr
    assert done.stderr.startswith("ops.export: --run nowhere: no run directory"), done.stderr
    (tmp_path / "runs" / "empty" / "checkpoints").mkdir(parents=True)
    code, err = export("--run", "empty", "hf")
    assert (code, err.count("\n")) == (1, 1), err
    assert "holds no trainer checkpoint" in err


def test_a_run_id_names_the_newest_run_directory(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(runs["torch"], tmp_path / "runs" / "demo-20260101-120000")
    (tmp_path / "runs" / "demo-20250101-120000").mkdir()  # older, and holds nothing
    code, err = export("--run", "demo", "hf")
    assert code == 0, err
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_the_model_comes_from_the_checkpoints_record_or_the_run_or_model(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["torch"], run)
    pointer = run / "checkpoints" / "rank0.pt"
    state = torch.load(pointer, weights_only=True)
    assert state.get("model_dir") == str((runs["torch"] / "model").resolve())  # the engine's record
    state["model_dir"] = str(tmp_path / "gone")
    torch.save(state, pointer)
    code, err = export("--run", str(run), str(tmp_path / "a"))  # falls back on RUN/model
    assert code == 0, err
    assert f"model config and tokenizer from {run / 'model'}" in err
    shutil.rmtree(run / "model")
    code, err = export("--run", str(run), str(tmp_path / "b"))
    assert (code, err.count("\n")) == (1, 1), err
    assert "give --model" in err
    code, err = export(
        "--run", str(run), "--model", str(runs["torch"] / "model"), str(tmp_path / "b")
    )
    assert code == 0, err


def test_a_non_empty_out_dir_is_refused_without_force(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.safetensors").write_text("old")
    code, err = export("--run", str(runs["torch"]), str(out))
    assert (code, err.count("\n")) == (1, 1), err
    assert "exists and is not empty (--force replaces it)" in err
    code, err = export("--run", str(runs["torch"]), "--force", str(out))
    assert code == 0, err
    assert not (out / "stale.safetensors").exists()
    assert (out / "model.safetensors").is_file()
