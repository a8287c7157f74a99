"""Contract tests against the real vLLM and SGLang packages, without a GPU and without starting
an engine: what the adapters send, the names they call, and how SGLang binds its loop.

vLLM and SGLang are not dependencies (multi-GB extras), so every test here skips, naming the
missing package, where it is not installed; CI skips them. Run them in a virtualenv holding
the package and ours importable (docs/engines.md, "Contract tests against the real packages",
records the last run):

    PYTHONPATH=$PWD /path/to/venv/bin/python -m pytest --noconftest tests/test_engine_contracts.py

- vLLM's own msgpack encoder (``vllm/v1/serial_utils.py``) on the exact message
  ``LLM.collective_rpc`` sends for a weight load (``SyncMPClient.call_utility``: client index,
  call id, "collective_rpc", (function, timeout, args, kwargs)): refused without
  VLLM_ALLOW_INSECURE_SERIALIZATION, carried with it; decoded as the engine core decodes it
  (``MsgpackDecoder()``, no types) and run as the worker runs it (``run_method``), it loads
  the bucket; a raw tensor argument would arrive as a list, as `tests.engine_standins`
  delivers it.
- Signatures: every keyword we pass to `vllm.LLM` / `AsyncEngineArgs` / `SamplingParams` and
  SGLang's `ServerArgs` / `SamplingParams` / request types is theirs (``enable_sleep_mode``
  and ``enable_memory_saver`` too), and every engine method we call binds the arguments we
  call it with (the release calls of colocation too: ``sleep`` / ``wake_up``,
  ``release_memory_occupation`` / ``resume_memory_occupation``).
- SGLang's loop binding (`Engine._ensure_event_loop`, what `Engine.__init__` keeps): the running
  loop where one runs (whose ``run_until_complete`` from another thread then fails, as the
  batch adapter's old build did), our `EngineThread`'s own loop there; and the stand-in binds
  as it does. The version floor: the installed SGLang guards ``signal.signal`` off the main
  thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib
import inspect
import threading
import time
import typing
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from engines.external_rollout import EngineThread, weight_buckets
from engines.protocols import SamplingParams
from engines.sglang_continuous import continuous_engine_kwargs, sglang_io
from engines.sglang_rollout import SGLangSettings, engine_kwargs, require_sglang, sampling_params
from engines.vllm_continuous import async_engine_kwargs, request_kwargs
from engines.vllm_rollout import (
    INSECURE_SERIALIZATION_ENV,
    LOGPROBS_MODE,
    VLLMSettings,
    allow_function_rpc,
    llm_kwargs,
    load_on_worker,
    pack_bucket,
    sampling_kwargs,
)
from tests.engine_standins import (
    HEADER_SLACK,
    NO_SESSION,
    OUTSIDE_SESSION,
    SESSION_OPEN,
    StandInSGLangEngine,
    as_vllm_delivers,
    bind_loop_as_sglang,
    vllm_refuses,
)

BUCKET = 64 * 1024
"""Bytes of tensor data per weight RPC in these tests."""


def package(module: str) -> ModuleType:
    """`module` imported, or the test skipped naming the package that is not installed."""
    top = module.split(".")[0]
    return pytest.importorskip(
        module, reason=f"{top} is not installed (pip install 'jetrl[{top}]'); contract not checked"
    )


def bucket() -> list[tuple[str, torch.Tensor]]:
    """The first bucket of a small model's weights, as the adapter cuts them."""
    gen = torch.Generator().manual_seed(0)
    weights = [
        ("model.embed_tokens.weight", torch.randn(64, 128, generator=gen)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(128, 128, generator=gen)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(128, 128, generator=gen)),
    ]
    return weight_buckets(weights, BUCKET)[0]


def rpc_message(method: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What ``LLM.collective_rpc(method, args=args)`` hands vLLM's encoder."""
    return (0, 7, "collective_rpc", (method, None, args, None))


@pytest.fixture
def no_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INSECURE_SERIALIZATION_ENV, "0")
    monkeypatch.delenv(INSECURE_SERIALIZATION_ENV)  # unset now, as it was afterwards


def test_vllm_refuses_our_loader_without_the_flag(no_flag: None) -> None:
    serial = package("vllm.v1.serial_utils")
    with pytest.raises(TypeError, match=INSECURE_SERIALIZATION_ENV):
        serial.MsgpackEncoder().encode(rpc_message(load_on_worker, (pack_bucket(bucket()),)))


def test_vllm_carries_our_loader_and_a_bucket_to_the_worker_with_the_flag(no_flag: None) -> None:
    serial = package("vllm.v1.serial_utils")
    allow_function_rpc()  # what both adapters do before the engine starts
    sent = bucket()
    packed = pack_bucket(sent)
    digest = hashlib.sha256(packed).hexdigest()
    frames = serial.MsgpackEncoder().encode(rpc_message(load_on_worker, (packed, digest)))
    size = sum(len(memoryview(frame)) for frame in frames)
    assert size <= BUCKET + HEADER_SLACK + 256, size  # the bucket bounds the message vLLM sends
    _, _, name, (method, timeout, args, kwargs) = serial.MsgpackDecoder().decode(frames)
    assert (name, method, timeout) == ("collective_rpc", load_on_worker, None)
    got: dict[str, torch.Tensor] = {}
    model = SimpleNamespace(
        load_weights=lambda weights: got.update(weights), named_parameters=lambda: iter(())
    )
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=model))
    answer = serial.run_method(worker, method, tuple(args), kwargs or {})
    assert (answer["sha256"], answer["loaded"]) == (digest, True), answer  # the bytes as sent
    assert list(got) == [n for n, _ in sent]
    for n, tensor in sent:
        assert torch.equal(got[n], tensor), n


def test_an_engine_core_started_without_the_flag_cannot_decode_our_loader(
    no_flag: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why the adapters set the flag before the engine starts: the engine-core process has the
    environment it started with; the stand-in refuses with vLLM's words."""
    serial = package("vllm.v1.serial_utils")
    allow_function_rpc()
    frames = serial.MsgpackEncoder().encode(rpc_message(load_on_worker, (b"",)))
    monkeypatch.delenv(INSECURE_SERIALIZATION_ENV)
    with pytest.raises(NotImplementedError) as refused:
        serial.MsgpackDecoder().decode(frames)
    monkeypatch.setenv(INSECURE_SERIALIZATION_ENV, "1")  # set now, not when the core started
    with pytest.raises(NotImplementedError) as stand_in:
        vllm_refuses(load_on_worker, flag_at_start=None)
    assert str(stand_in.value) == str(refused.value)


def test_a_raw_tensor_argument_reaches_vllms_worker_as_the_stand_in_delivers_it(
    no_flag: None,
) -> None:
    serial = package("vllm.v1.serial_utils")
    allow_function_rpc()
    name, tensor = bucket()[0]
    frames = serial.MsgpackEncoder().encode(rpc_message(load_on_worker, ([(name, tensor)],)))
    delivered = serial.MsgpackDecoder().decode(frames)[3][2][0][0]
    assert not isinstance(delivered[1], torch.Tensor)  # why pack_bucket sends bytes
    ours = as_vllm_delivers([(name, tensor)])[0]
    assert [delivered[0], delivered[1][:2]] == [ours[0], ours[1][:2]], (delivered, ours)


def binds(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """`fn` takes these arguments (a method: with a placeholder self first)."""
    inspect.signature(fn).bind(*args, **kwargs)


def test_vllm_takes_every_name_we_pass() -> None:
    vllm = package("vllm")
    engine_args = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    for kwargs in (
        llm_kwargs(Path("/m"), VLLMSettings()),
        async_engine_kwargs(Path("/m"), VLLMSettings(), 8),
    ):
        assert set(kwargs) <= engine_args, set(kwargs) - engine_args
    assert set(async_engine_kwargs(Path("/m"), VLLMSettings(), 8)) <= {
        f.name for f in dataclasses.fields(vllm.AsyncEngineArgs)
    }
    model_config = importlib.import_module("vllm.config.model")
    assert LOGPROBS_MODE in typing.get_args(model_config.LogprobsMode)
    delta = importlib.import_module("vllm.sampling_params").RequestOutputKind.DELTA
    params = SamplingParams(temperature=0.7, max_tokens=8, stop_token_ids=(7,))
    vllm.SamplingParams(**sampling_kwargs(params, 2, (2,), seed=3))
    vllm.SamplingParams(**request_kwargs(params, (2,), delta))
    llm, sampling = vllm.LLM, vllm.SamplingParams()
    binds(llm.generate, llm, [{"prompt_token_ids": [1, 2]}], sampling, use_tqdm=False)
    binds(llm.collective_rpc, llm, load_on_worker, args=(b"",))
    binds(llm.reset_prefix_cache, llm)
    binds(llm.sleep, llm, level=1)  # colocated: release_memory / resume_memory
    binds(llm.wake_up, llm)
    assert llm_kwargs(Path("/m"), VLLMSettings(sleep_mode=True))["enable_sleep_mode"] is True
    engine = vllm.AsyncLLMEngine
    binds(engine.from_engine_args, vllm.AsyncEngineArgs(model="/m"))
    binds(engine.generate, engine, {"prompt_token_ids": [1]}, sampling, request_id="r")
    binds(engine.abort, engine, ["r"])
    binds(engine.pause_generation, engine, mode="keep", clear_cache=False)
    mode = inspect.signature(engine.pause_generation).parameters["mode"].annotation
    assert "'keep'" in str(mode), mode
    binds(engine.resume_generation, engine)
    binds(engine.collective_rpc, engine, load_on_worker, args=(b"",))
    binds(engine.reset_prefix_cache, engine)
    binds(engine.shutdown, engine)


def sglang_engine() -> Any:
    """SGLang's `Engine` class (``sglang.Engine`` is a lazy import of it)."""
    package("sglang")
    return package("sglang.srt.entrypoints.engine").Engine


def test_sglang_takes_every_name_we_pass() -> None:
    engine = sglang_engine()
    require_sglang()  # the installed version is at or above the floor
    server_args = set(inspect.signature(package("sglang.srt.server_args").ServerArgs).parameters)
    for kwargs in (
        engine_kwargs(Path("/m"), SGLangSettings()),
        continuous_engine_kwargs(Path("/m"), SGLangSettings(), 8),
    ):
        assert set(kwargs) <= server_args, set(kwargs) - server_args
    request = sampling_params(SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8), (2,))
    package("sglang.srt.sampling.sampling_params").SamplingParams(**request)
    binds(engine.generate, engine, input_ids=[[1, 2]], sampling_params=request, return_logprob=True)
    binds(
        engine.async_generate,
        engine,
        input_ids=[1, 2],
        sampling_params=request,
        return_logprob=True,
        stream=True,
        rid="r",
    )
    binds(engine.update_weights_from_tensor, engine, named_tensors=[], flush_cache=True)
    binds(engine.get_weights_by_name, engine, "model.norm.weight", truncate_size=1)
    binds(engine.shutdown, engine)
    binds(engine.release_memory_occupation, engine)  # colocated: release_memory / resume_memory
    binds(engine.resume_memory_occupation, engine)
    io = sglang_io()
    assert io.pause is not None and io.resume is not None
    update = io.update(
        serialized_named_tensors=[io.serialize(bucket())], load_format=None, flush_cache=True
    )
    manager = package("sglang.srt.managers.tokenizer_manager").TokenizerManager
    binds(manager.abort_request, manager, "r")
    binds(manager.pause_generation, manager, io.pause(mode="retract"))
    binds(manager.continue_generation, manager, io.resume())
    binds(manager.update_weights_from_tensor, manager, update, None)
    assert io.begin is not None and io.end is not None  # the session the adapter opens
    binds(manager.begin_weight_update, manager, io.begin(), None)
    binds(manager.end_weight_update, manager, io.end(), None)
    read = io.read(name="model.norm.weight", truncate_size=1)
    binds(manager.get_weights_by_name, manager, read, None)


def test_sglang_binds_the_running_loop_else_the_threads_own_as_the_stand_in_does() -> None:
    engine = sglang_engine()
    ensure = getattr(engine, "_ensure_event_loop", None)
    if ensure is None:
        pytest.skip("this SGLang binds its loop inline in Engine.__init__: nothing to call alone")

    async def worker() -> None:
        running = asyncio.get_running_loop()
        assert ensure() is running and bind_loop_as_sglang() is running
        probe = asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already running"):  # Engine.generate, to_thread
            await asyncio.to_thread(running.run_until_complete, probe)
        probe.close()
        thread = EngineThread("contract-sglang")
        try:
            bound = await asyncio.to_thread(thread.call, ensure)
            assert bound is not running and not bound.is_running()
            assert await asyncio.to_thread(thread.call, bind_loop_as_sglang) is bound
            done = await asyncio.to_thread(thread.call, bound.run_until_complete, answer())
            assert done == "ran on the engine's own loop"
        finally:
            thread.close()

    async def answer() -> str:
        return "ran on the engine's own loop"

    asyncio.run(worker())
    fresh: list[asyncio.AbstractEventLoop] = []
    thread = threading.Thread(target=lambda: fresh.extend([ensure(), bind_loop_as_sglang()]))
    thread.start()
    thread.join()
    assert fresh[0] is fresh[1] and not fresh[0].is_running()  # a new loop, set as the thread's
    fresh[0].close()


def test_sglang_registers_no_signal_handler_off_the_main_thread() -> None:
    sglang_engine()
    source = inspect.getsource(package("sglang.srt.entrypoints.engine")._set_envs_and_config)
    guard = source.find("threading.current_thread() is threading.main_thread()")
    assert 0 <= guard < source.find("signal.signal("), "signal.signal is not behind the guard"


# --- The collective transport into the engine (issue 28) ---------------------------------------


def test_sglang_distributed_update_calls_are_the_stand_ins() -> None:
    """Every call `engines.sglang_group` and the SGLang adapter make binds on the real `Engine`,
    with the stand-in's parameter names and defaults; the real scheduler refuses an update
    outside a weight-update session, an end outside one and a begin inside one, with the
    stand-ins' words (`StandInSGLangEngine`, `tests.continuous_fakes.FakeTokenizerManager`)."""
    engine = sglang_engine()
    for name in (
        "init_weights_update_group",
        "update_weights_from_distributed",
        "destroy_weights_update_group",
        "begin_weight_update",
        "end_weight_update",
        "get_weights_by_name",
        "update_weights_from_tensor",
        "release_memory_occupation",
        "resume_memory_occupation",
    ):
        real = inspect.signature(getattr(engine, name)).parameters
        ours = inspect.signature(getattr(StandInSGLangEngine, name)).parameters
        assert [(p.name, p.default) for p in real.values()] == [
            (p.name, p.default) for p in ours.values()
        ], name
    binds(
        engine.init_weights_update_group, engine, master_address="h", master_port=1,
        rank_offset=1, world_size=2, group_name="g", backend="gloo",
    )  # fmt: skip
    binds(
        engine.update_weights_from_distributed, engine, names=["a"], dtypes=["float32"],
        shapes=[[2]], group_name="g", flush_cache=True,
    )  # fmt: skip
    binds(engine.destroy_weights_update_group, engine, group_name="g")
    io = package("sglang.srt.managers.io_struct")
    manager = package("sglang.srt.managers.scheduler_components.weight_updater")
    updater = manager.SchedulerWeightUpdaterManager
    no_session = SimpleNamespace(_session=None)
    request = io.UpdateWeightsFromDistributedReqInput(names=[], dtypes=[], shapes=[])
    out = updater.update_weights_from_distributed(no_session, request)
    assert not out.success
    assert out.message == OUTSIDE_SESSION.format("update_weights_from_distributed")
    tensors = io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[])
    out = updater.update_weights_from_tensor(no_session, tensors)
    assert not out.success
    assert out.message == OUTSIDE_SESSION.format("update_weights_from_tensor")
    out = updater.end_weight_update(no_session, io.EndWeightUpdateReqInput())
    assert (out.success, out.message) == (False, NO_SESSION)
    open_session = SimpleNamespace(_session=object())
    out = updater.begin_weight_update(open_session, io.BeginWeightUpdateReqInput())
    assert (out.success, out.message) == (False, SESSION_OPEN)


def source_side(port: int, name: str) -> None:
    """Our source's side of a tensor-mode group (`custom_group` on the TCPStore it hosts, as
    `engines.collective` opens it): broadcasts one tensor from rank 0."""
    from datetime import timedelta

    import torch.distributed as dist

    from engines.collective import CollectiveSettings
    from engines.collective_tensors import open_tensor_group

    t = timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, None, True, t)
    backend = open_tensor_group(store, 0, 2, name, CollectiveSettings())
    backend.broadcast(torch.arange(6, dtype=torch.bfloat16), 0, t).wait()  # type: ignore[union-attr]
    time.sleep(1)


def test_sglangs_own_rendezvous_joins_our_sources_group() -> None:
    """SGLang's real `init_custom_process_group` (what `init_weights_update_group` runs on each
    TP rank), over ``tcp://`` at our source's store, joins the group our source opens, and a
    broadcast from it arrives as `update_weights_from_distributed` receives it."""
    common = package("sglang.srt.utils.common")
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = "jetrl-weights-contract-e1"
    source = multiprocessing.get_context("spawn").Process(target=source_side, args=(port, name))
    source.start()
    try:
        time.sleep(0.5)
        from datetime import timedelta

        group = common.init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
            group_name=name, timeout=timedelta(seconds=30),
        )  # fmt: skip
        weight = torch.empty(6, dtype=torch.bfloat16)
        torch.distributed.broadcast(weight, src=0, group=group, async_op=True).wait()
        assert torch.equal(weight, torch.arange(6, dtype=torch.bfloat16))
    finally:
        source.join(timeout=30)
        if source.is_alive():
            source.kill()
    assert source.exitcode == 0


def test_vllm_weight_transfer_is_what_the_docs_say() -> None:
    """vLLM's weight-transfer path (docs/engines.md): `AsyncLLM`'s init / start / update /
    finish calls, on `AsyncLLM` and the offline `LLM` alike; backends without gloo (NCCL
    through its own communicator); the update info's names; the workers' methods."""
    package("vllm")
    async_llm = package("vllm.v1.engine.async_llm").AsyncLLM
    for name in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ):
        assert callable(getattr(async_llm, name)), name
    llm = package("vllm").LLM
    binds(llm.init_weight_transfer_engine, llm, {"init_info": {}})
    binds(llm.start_weight_update, llm)
    binds(llm.update_weights, llm, {"update_info": {}})
    binds(llm.finish_weight_update, llm, weight_version="1")
    config = package("vllm.config.weight_transfer").WeightTransferConfig
    backends = typing.get_args(typing.get_args(config.__annotations__["backend"])[0])
    assert "nccl" in backends and "gloo" not in backends, backends
    nccl = package("vllm.distributed.weight_transfer.nccl_engine")
    fields = {f.name for f in dataclasses.fields(nccl.NCCLWeightTransferUpdateInfo)}
    assert {"names", "dtype_names", "shapes"} <= fields, fields
    worker = package("vllm.v1.worker.gpu_worker").Worker
    for name in ("init_weight_transfer_engine", "start_weight_update", "update_weights"):
        assert callable(getattr(worker, name)), name
