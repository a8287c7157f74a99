"""`model.path` as a Hugging Face directory or a hub id (`engines.model_source`).

- `resolve_model_path` on a local directory, a hub id in a prepared hub cache with
  HF_HUB_OFFLINE=1 (at the default branch and at a pinned commit), and the one-line errors for
  what it cannot use;
- a chat prompt tokenized through the model's chat template under transformers 5;
- the built-in job end to end, its model given as a saved HF directory and as a hub id served
  from a prepared cache (offline): tokenizer, generation, training and weights back to rollout
  all load from the resolved directory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.runtime import publish_config
from bus.topology import Topology
from consumers.rollout import Rollout
from engines.model_source import ModelNotFound, resolve_model_path
from engines.tiny import build_tiny_model
from producers.tasks import VOCAB
from schemas import PromptEvent
from schemas.config import parse_config
from tests.helpers import served_versions

ROOT = Path(__file__).resolve().parent.parent
REPO = "jetrl-test/tiny-digits"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny", VOCAB)


def hub_cache(root: Path, model: Path, repo: str = REPO, commit: str = COMMIT) -> Path:
    """`root` laid out as huggingface_hub's cache holding `model` as `repo` at `commit`
    (refs/main)."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    shutil.copytree(model, snapshot)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return root


def offline(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_local_directory_is_used_as_it_is(model_dir: Path) -> None:
    assert resolve_model_path(str(model_dir)) == model_dir.resolve()


def test_a_hub_id_resolves_to_its_snapshot_in_the_cache_offline(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offline(monkeypatch, hub_cache(tmp_path / "cache", model_dir))
    snapshot = tmp_path / "cache" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert resolve_model_path(REPO) == snapshot
    assert resolve_model_path(REPO, COMMIT) == snapshot


@pytest.mark.parametrize(
    "path, revision, says",
    [
        ("", None, "model.path is empty"),
        ("/nonexistent/model", None, "no such directory, and not a hub id"),
        ("jetrl-test/not-cached", None, "is not in the hub cache"),
        (REPO, "feedfacefeedfacefeedfacefeedfacefeedface", "is not in the hub cache"),
    ],
)
def test_what_cannot_be_used_is_one_line_naming_it(
    model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    revision: str | None,
    says: str,
) -> None:
    offline(monkeypatch, hub_cache(tmp_path / "cache", model_dir))
    with pytest.raises(ModelNotFound) as error:
        resolve_model_path(path, revision)
    message = str(error.value)
    assert says in message and "\n" not in message, message
    if path == "jetrl-test/not-cached":
        assert "HF_HUB_OFFLINE" in message and str(tmp_path / "cache") in message, message


def test_a_directory_without_a_config_and_a_revision_on_a_local_directory_are_refused(
    model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ModelNotFound, match="without config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelNotFound, match="model.revision"):
        resolve_model_path(str(model_dir), "main")


def test_chat_messages_are_token_ids_through_the_chat_template(
    model_dir: Path, tmp_path: Path
) -> None:
    """transformers 5's `apply_chat_template(tokenize=True)` returns a dict unless told not to:
    the rollout must hand the engine the ids, not the dict's keys."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}={% endif %}"
    )
    prompt = PromptEvent(
        id="r/0/0", run="r", epoch=0, index=0, messages=({"role": "user", "content": "A1234"},)
    )
    ids = Rollout.token_ids(SimpleNamespace(tokenizer=tokenizer), prompt)  # type: ignore[arg-type]
    assert ids == tokenizer.encode("A1234=", add_special_tokens=False), ids
    assert all(isinstance(i, int) for i in ids)


def run_job(tmp_path: Path, model: str, env: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """The built-in job for STEPS steps with `model` as model.path; its summary and logs."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "job.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": f"mp-{tmp_path.name[-12:]}",
                "model": {"path": model},
                "data": {"task": "digits", "n": 4, "sampling": {"max_tokens": 6}},
                "algorithm": {"prompts_per_step": 4, "max_staleness": 1},
                "trainer": {"steps": STEPS},
            }
        )
    )
    out = tmp_path / "run"
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--config",
            str(config),
            "--steps",
            str(STEPS),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
        env=env,
    )
    logs = (
        {p.name: p.read_text() for p in (out / "logs").glob("*.log")}
        if (out / "logs").exists()
        else {}
    )
    assert job.returncode == 0, job.stderr[-2000:] + "".join(text[-1500:] for text in logs.values())
    return json.loads(job.stdout.strip().splitlines()[-1]), logs


@pytest.mark.timeout(600)
def test_the_built_in_job_runs_on_an_hf_directory_and_on_a_hub_id_from_the_cache(
    model_dir: Path, tmp_path: Path
) -> None:
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    summary, logs = run_job(tmp_path / "dir", str(model_dir), base)
    assert summary["steps"] == STEPS and summary["samples_trained"] == STEPS * 4 * 4, summary
    rollout = "".join(text for name, text in logs.items() if name.startswith("rollout"))
    assert f"loads from {model_dir.resolve()}" in rollout, rollout[-2000:]

    cache = hub_cache(tmp_path / "cache", model_dir)
    summary, logs = run_job(
        tmp_path / "hub", REPO, {**base, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    )
    assert summary["steps"] == STEPS and summary["samples_trained"] == STEPS * 4 * 4, summary
    rollout = "".join(text for name, text in logs.items() if name.startswith("rollout"))
    snapshot = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert f"model {REPO} loads from {snapshot}" in rollout, rollout[-2000:]
    served = served_versions(rollout)
    assert served and max(served) >= STEPS - 1, f"weights did not come back to rollout: {served}"


@pytest.mark.parametrize("role", ["rollout", "trainer"])
def test_a_worker_whose_hub_model_is_not_cached_offline_stops_with_one_line(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path, role: str
) -> None:
    import asyncio
    import os

    async def setup() -> None:
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        await topology.apply(js)
        config = parse_config(
            {
                "run": topology.run,
                "model": {"path": "jetrl-test/not-cached", "revision": "main"},
                "trainer": {"checkpoint_dir": str(tmp_path / "ckpt")},
            }
        )
        await publish_config(await js.key_value(topology.kv_bucket), config)
        await nc.close()

    asyncio.run(setup())
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty-cache"), "HF_HUB_OFFLINE": "1"}
    worker = subprocess.run(
        [
            sys.executable,
            "-m",
            f"consumers.{role}",
            "--run",
            topology.run,
            "--nats",
            nats_server.url,
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    last = worker.stderr.strip().splitlines()[-1] if worker.stderr.strip() else ""
    assert worker.returncode == 1, worker.stderr[-2000:]
    assert last.startswith(
        f"consumers.{role}: model jetrl-test/not-cached@main is not in the hub cache"
    ), last
    assert "HF_HUB_OFFLINE" in last and "Traceback" not in worker.stderr, worker.stderr[-2000:]


def test_the_local_job_makes_a_relative_model_directory_absolute_and_leaves_a_hub_id(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from producers.launcher import prepare
    from schemas.config import RunConfig

    monkeypatch.chdir(model_dir.parent)
    relative = prepare(
        RunConfig.model_validate({"model": {"path": model_dir.name}}), tmp_path / "run"
    )
    assert relative.model.path == str(model_dir.resolve())  # workers may start in another directory
    hub = prepare(RunConfig.model_validate({"model": {"path": REPO}}), tmp_path / "run")
    assert hub.model.path == REPO
