"""The reward sandbox never hides the project or the user's environment (issue 26).

The sandbox's /tmp is a private tmpfs, so a checkout or a venv under the worker's /tmp would be
out of sight: `kept_paths` (pure) picks the import roots it must bind back in, `import_roots`
gathers them from the running interpreter, and the end-to-end test runs the built-in reward from
an editable install of this project into a venv, both under /tmp, launched from another
directory (where neither is on sys.path: setuptools' editable finder maps the packages).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumers import reward_sandbox
from consumers.reward_sandbox import import_roots, kept_paths

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bus", "consumers", "engines", "ops", "producers", "schemas")
ISOLATED = asyncio.run(reward_sandbox.choose("auto"))


# --- kept_paths: pure ------------------------------------------------------------------------


def test_only_paths_under_a_private_dir_are_kept_outer_first_without_nested_or_duplicates() -> None:
    roots = [
        "/usr/lib/python3.11",
        "/tmp/venv/lib/python3.11/site-packages",
        "/tmp/venv",
        "/tmp/venv/",
        "/tmp/co/producers",
        "/tmp/co/consumers/../consumers",
        "/tmp/co-other",
        "/dev/shm/lib",
        "/work/main",
    ]
    assert kept_paths(roots) == [
        "/dev/shm/lib",
        "/tmp/co-other",
        "/tmp/co/consumers",
        "/tmp/co/producers",
        "/tmp/venv",
    ]


def test_a_private_dir_itself_a_relative_path_or_a_lookalike_is_never_kept() -> None:
    """Binding /tmp back would undo the private /tmp; /tmpfoo is not under /tmp."""
    assert kept_paths(["/tmp", "/tmp/", "/dev/shm", "tmp/x", "", "/tmpfoo/x", "/var/tmp/x"]) == []


def test_the_private_dirs_are_a_parameter() -> None:
    assert kept_paths(["/scratch/a", "/tmp/b"], private=["/scratch/"]) == ["/scratch/a"]


# --- import_roots: what the interpreter imports from ----------------------------------------


def test_import_roots_take_editable_finder_mappings_pythonpath_and_the_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setuptools-style editable finder (MAPPING and NAMESPACES in its module) maps packages
    to directories on no sys.path entry; a single-module mapping counts as its directory."""
    mapped, spaced, single, extra = (tmp_path / name for name in ("mapped", "ns", "one", "pp"))
    for directory in (mapped, spaced, single, extra):
        directory.mkdir()
    (single / "mod.py").write_text("")
    module = types.ModuleType("__editable___fake_finder")
    module.MAPPING = {"pkg": str(mapped), "mod": str(single / "mod.py")}  # type: ignore[attr-defined]
    module.NAMESPACES = {"ns": [str(spaced)]}  # type: ignore[attr-defined]
    finder = type("_EditableFinder", (), {"__module__": module.__name__})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, finder])
    roots = import_roots({"PYTHONPATH": f"{extra}{os.pathsep}{tmp_path / 'missing'}"})
    for directory in (mapped, spaced, single, extra, Path(sys.prefix)):
        assert str(directory) in roots, (directory, roots)
    assert str(tmp_path / "missing") not in roots and str(single / "mod.py") not in roots


# --- end to end: an editable install under /tmp, launched from elsewhere ----------------------


@pytest.fixture
def tmp_install() -> Iterator[Path]:
    """A copy of the project editable-installed into a venv, both under /tmp; the venv reads the
    test interpreter's packages (dependencies) through a .pth line."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="jetrl-sbx-") as name:
        base = Path(name)
        checkout = base / "checkout"
        checkout.mkdir()
        for package in PACKAGES:
            shutil.copytree(
                ROOT / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__")
            )
        for file in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / file, checkout / file)
        venv = base / "venv"
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60
        )
        python = venv / "bin" / "python"
        site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
            env=_without_pythonpath(),
        ).stdout.strip()
        (Path(site) / "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        install = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
            + ["--no-build-isolation", "--no-index", "-e", str(checkout)],
            capture_output=True,
            text=True,
            timeout=180,
            env=_without_pythonpath(),
            check=False,
        )
        if install.returncode != 0:
            pytest.skip(f"cannot editable-install here: {install.stderr.strip()[-300:]}")
        yield base


PROBE = """
import asyncio, json
import consumers
from consumers.reward_pool import RewardPool

async def main():
    async with RewardPool(1, 30, isolation="required") as pool:
        score = await pool.score(
            "producers.tasks:score_reverse", "321", {"name": "reverse", "target": "321"}
        )
    print(json.dumps({"from": consumers.__file__, "reward": score.reward, "why": score.reason}))

asyncio.run(main())
"""


@pytest.mark.skipif(not ISOLATED, reason="user/net/pid/mount namespaces cannot be made here")
@pytest.mark.timeout(300)
def test_an_editable_install_under_tmp_runs_the_sandboxed_reward_from_another_directory(
    tmp_install: Path,
) -> None:
    probe = subprocess.run(
        [str(tmp_install / "venv" / "bin" / "python"), "-c", PROBE],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        env=_without_pythonpath(),
        check=False,
    )
    assert probe.returncode == 0, probe.stderr[-1500:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["from"].startswith(str(tmp_install / "checkout")), (
        result
    )  # the copy, not this checkout
    assert (result["reward"], result["why"]) == (1.0, ""), result


def _without_pythonpath() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


@pytest.mark.skipif(not ISOLATED, reason="user/net/pid/mount namespaces cannot be made here")
def test_an_identity_under_a_kept_import_root_stays_hidden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkout under /tmp is bound back in with the job's identities inside it (runs/...):
    the identity's directory is hidden all the same, and the checkout's code imports."""
    from bus.identity import IDENTITY_ENV, new_seed, write_private
    from tests.test_reward import FNS, score_then_recover

    seed = tmp_path / "runs" / "identities" / "reward.nk"
    seed.parent.mkdir(parents=True, mode=0o700)
    write_private(seed, new_seed())
    module = f"kept_{tmp_path.name[-8:].replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(f"from {FNS} import read_identity\n")
    monkeypatch.setenv(IDENTITY_ENV, str(seed))
    monkeypatch.syspath_prepend(str(tmp_path))
    score, _, after = score_then_recover(f"{module}:read_identity", {"path": str(seed)})
    assert score.reason == (
        f"raised FileNotFoundError: [Errno 2] No such file or directory: '{seed}'"
    ), score
    assert after.reward == 1.0
