"""Stand-ins for `vllm.LLM` and `sglang.Engine` (and the modules that hold them), for CPU tests
of the batch adapters, refusing what the real packages refuse.

A stand-in that accepts what the real package refuses is a test that cannot fail, so these copy
two behaviours from the packages' source (tests/test_engine_contracts.py checks them against
the real packages where those are installed):

- vLLM (``vllm/v1/serial_utils.py`` `MsgpackEncoder.enc_hook`): `collective_rpc` with a
  function, not a method name, is refused with a `TypeError` unless
  ``VLLM_ALLOW_INSECURE_SERIALIZATION`` reads as on (``bool(int(value))``), both now (the
  client's encoder) and when the engine was built (the engine-core process's decoder, which
  inherited the environment when it started); and the engine core decodes the call without
  types (``vllm/v1/engine/core.py``: ``generic_decoder``), so a tensor argument reaches the
  worker as ``[dtype, shape, buffer]``. `vllm_rpc` is that behaviour; every vLLM stand-in
  (here and `tests.continuous_fakes`) goes through it and records the bytes of each RPC.
- SGLang (``python/sglang/srt/entrypoints/engine.py`` `Engine.__init__`): the engine binds the
  loop running in the thread that builds it, else that thread's current loop, else a new one
  it sets as the thread's (`bind_loop_as_sglang`); its synchronous methods run that loop with
  ``run_until_complete``, which real asyncio refuses while the loop runs in any thread.

`StandInLLM` and `StandInSGLangEngine` generate with our HF engine and report as the engines do
(`tests.engine_records`); `vllm_module` / `sglang_modules` are what `sys.modules` must hold for
the adapters' constructors to build them.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from engines.external_rollout import torch_dtype
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import SamplingParams
from engines.sglang_rollout import SGLANG_FLOOR
from engines.vllm_rollout import INSECURE_SERIALIZATION_ENV
from engines.weights_group import custom_group
from tests.engine_records import sglang_report, vllm_objects, vllm_report

OUTSIDE_SESSION = "{} must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_SESSION = "no weight-update session is open; call begin_weight_update() first"

HEADER_SLACK = 4096
"""Bytes one weight RPC may carry beyond its bucket's tensor data (the safetensors header)."""


def flag_on(value: str | None) -> bool:
    """``VLLM_ALLOW_INSECURE_SERIALIZATION`` as vLLM's ``envs`` reads it."""
    try:
        return bool(int(value or "0"))
    except ValueError:
        return False


def vllm_refuses(method: Any, flag_at_start: str | None) -> None:
    """Raises what vLLM raises for `collective_rpc(method)`: a function without the flag."""
    if isinstance(method, str):
        return  # a method name travels as a plain string
    if not flag_on(os.environ.get(INSECURE_SERIALIZATION_ENV)):
        raise TypeError(
            f"Object of type {type(method)} is not serializable"
            f"Set {INSECURE_SERIALIZATION_ENV}=1 to allow fallback to pickle-based serialization."
        )
    if not flag_on(flag_at_start):
        raise NotImplementedError("Extension type code 2 is not supported")  # the core's decoder


def payload_bytes(value: Any) -> int:
    """Bytes of every tensor and bytes object in `value` (nested tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(payload_bytes(v) for v in value)
    return 0


def as_vllm_delivers(value: Any) -> Any:
    """`value`, an argument of `collective_rpc`, as the engine-core process hands it on: vLLM
    decodes a utility call without types (``MsgpackDecoder()``), so a tensor arrives as
    ``[dtype, shape, buffer]`` and a tuple as a list."""
    if isinstance(value, torch.Tensor):
        data = value.contiguous().view(torch.uint8).numpy().tobytes()
        return [str(value.dtype).removeprefix("torch."), list(value.shape), data]
    if isinstance(value, dict):
        return {k: as_vllm_delivers(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_vllm_delivers(v) for v in value]
    return value


def vllm_rpc(
    worker: Any,
    method: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    flag_at_start: str | None,
) -> Any:
    """One worker's share of `collective_rpc`, as vLLM runs it: refused (`vllm_refuses`), or
    the method called with the worker first and the arguments `as_vllm_delivers` them."""
    vllm_refuses(method, flag_at_start)
    delivered = as_vllm_delivers(kwargs or {})
    return method(worker, *as_vllm_delivers(args), **delivered)


class Loader:
    """A vLLM worker's ``model_runner.model``: `load_weights(weights=iterable)` copies each
    (HF name, tensor) into the parameter of that name of a real HF module."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.calls = module, 0
        self.skip: set[str] = set()
        """Names `load_weights` passes over without a word, as vLLM's loaders pass over some
        (a bias the model lacks, a pipeline stage's missing layer): a load the read-back must
        catch."""
        self.asleep = False
        """The engine sleeps (`StandInLLM.sleep`): its weights are unmapped."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.asleep:  # vLLM would write into unmapped memory; ours would crash the process
            raise RuntimeError("stand-in vllm: a weight load into a sleeping engine's memory")
        self.calls += 1
        params = dict(self.module.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name in self.skip:
                    continue
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The model's parameters, as a vLLM model (an `nn.Module`) lists them."""
        return self.module.named_parameters()


class StandInLLM:
    """`vllm.LLM(**engine args)`: generate / collective_rpc / reset_prefix_cache over our HF
    engine, one in-process worker."""

    def __init__(self, model: str, seed: int = 0, dtype: str = "auto", **engine_args: Any) -> None:
        self.hf = HFRolloutEngine(Path(model), dtype=torch_dtype(dtype) or torch.float32, seed=seed)
        self.engine_args = engine_args
        self.flag_at_start = os.environ.get(INSECURE_SERIALIZATION_ENV)
        self.loader = Loader(self.hf.model)
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.loader))
        self.events: list[str] = []
        self.rpc_bytes: list[int] = []
        """Bytes (tensors and bytes objects) each `collective_rpc` carried, in order."""
        self.corrupt = False
        """Flip a byte of each bucket on its way to the worker."""

    def generate(
        self, prompts: list[dict[str, list[int]]], sampling: dict[str, Any], use_tqdm: bool
    ) -> list[Any]:
        ids = [p["prompt_token_ids"] for p in prompts]
        params = SamplingParams(
            sampling["temperature"],
            sampling["top_p"],
            sampling["max_tokens"],
            tuple(sampling["stop_token_ids"]),
        )
        return vllm_objects(vllm_report(ids, self.hf.generate(ids, sampling["n"], params)))

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        if self.corrupt and args and isinstance(args[0], bytes):
            # A bucket changed on the way: its last byte (tensor data) flipped.
            args = (args[0][:-1] + bytes([args[0][-1] ^ 0xFF]), *args[1:])
        result = vllm_rpc(self.worker, method, args, kwargs, self.flag_at_start)
        self.rpc_bytes.append(payload_bytes((args, kwargs)))
        self.events.append("load")
        return [result]

    def reset_prefix_cache(self) -> bool:
        self.events.append("reset prefix cache")
        return True

    def sleep(self, level: int = 1) -> None:
        """`LLM.sleep`: refused, as vLLM's engine core asserts, on an engine built without
        ``enable_sleep_mode``. Asleep, the worker's parameters are gone (vLLM unmaps them):
        a load into them fails, and so does a generation."""
        self.require_sleep_mode()
        self.hf.release_memory()
        self.loader.asleep = True
        self.events.append(f"sleep {level}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.require_sleep_mode()
        self.hf.resume_memory()
        self.loader.asleep = False
        self.events.append("wake up")

    def require_sleep_mode(self) -> None:
        assert self.engine_args.get("enable_sleep_mode"), (
            "Sleep mode is not enabled in the model config"
        )


def vllm_module(
    llm: Callable[..., Any] = StandInLLM, async_engine: Callable[[Any], Any] | None = None
) -> dict[str, ModuleType]:
    """`sys.modules` entries for ``vllm`` and ``vllm.sampling_params``: `llm` builds `vllm.LLM`,
    `async_engine` (engine args -> engine) `AsyncLLMEngine.from_engine_args`."""
    vllm = ModuleType("vllm")
    vllm.LLM = llm  # type: ignore[attr-defined]
    vllm.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    vllm.AsyncEngineArgs = lambda **kw: kw  # type: ignore[attr-defined]
    vllm.AsyncLLMEngine = SimpleNamespace(from_engine_args=async_engine)  # type: ignore[attr-defined]
    sampling = ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = SimpleNamespace(DELTA="DELTA")  # type: ignore[attr-defined]
    return {"vllm": vllm, "vllm.sampling_params": sampling}


def bind_loop_as_sglang() -> asyncio.AbstractEventLoop:
    """The loop `sglang.Engine.__init__` keeps (SGLang 0.5.23 `Engine._ensure_event_loop`): the
    one running in the building thread, else that thread's current loop, else a new one set as
    its current loop."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    try:
        return asyncio.get_event_loop_policy().get_event_loop()
    except RuntimeError:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        return loop


class StandInSGLangEngine:
    """`sglang.Engine(**server args)`: the synchronous `generate` and
    `update_weights_from_tensor`, each running the bound loop as SGLang does."""

    def __init__(
        self, model_path: str, random_seed: int = 0, dtype: str = "auto", **server_args: Any
    ) -> None:
        weights = torch_dtype(dtype) or torch.float32
        self.hf = HFRolloutEngine(Path(model_path), dtype=weights, seed=random_seed)
        self.server_args = server_args
        self.flushed: list[bool] = []
        self.refuse_loads = False
        """Answer loads as SGLang answers a failed one: ``(False, message)``."""
        self.skip: set[str] = set()
        """Names an update passes over while answering success (a loader that skips a name)."""
        self.updates: list[list[str]] = []
        """The names of each `update_weights_from_tensor` call, in order."""
        self.shut_down_on: str | None = None
        """The thread `shutdown` ran on."""
        self.session = False
        """A weight-update session is open (`begin_weight_update`)."""
        self.groups: dict[str, dist.ProcessGroup] = {}
        """Weight-update groups joined, by name (SGLang's `_model_update_group`)."""
        self.group_timeout = timedelta(seconds=30)
        """SGLang passes none (torch's default, 30 min); short here so a test cannot hang."""
        self.break_at: int | None = None
        """`update_weights_from_distributed` breaks its group at this tensor (None: never)."""
        self.occupation: list[str] = []
        """Each `release_memory_occupation` and `resume_memory_occupation`, in order."""
        self.loop = bind_loop_as_sglang()  # last, as in SGLang

    async def _generate(
        self, input_ids: list[list[int]], sampling_params: dict[str, Any]
    ) -> list[dict[str, Any]]:
        params = SamplingParams(
            sampling_params["temperature"],
            sampling_params["top_p"],
            sampling_params["max_new_tokens"],
            tuple(sampling_params["stop_token_ids"]),
        )
        return sglang_report(self.hf.generate(input_ids, 1, params))

    def generate(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any],
        return_logprob: bool = False,
    ) -> list[dict[str, Any]]:
        assert return_logprob and sampling_params["no_stop_trim"], sampling_params
        return self.loop.run_until_complete(self._generate(input_ids, sampling_params))

    def check_held(self) -> None:
        """Released, SGLang's weights are unmapped: reading or writing them would crash the
        process (ours too: their storages have 0 bytes), so the stand-in refuses it."""
        if self.hf.offload.released:
            raise RuntimeError("stand-in sglang: the weights' memory is released")

    async def _update(self, named_tensors: list[tuple[str, torch.Tensor]], flush: bool) -> None:
        self.check_held()
        params = dict(self.hf.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                assert tensor.dtype == params[name].dtype, name
                if name not in self.skip:
                    params[name].copy_(tensor)
        self.flushed.append(flush)
        self.updates.append([name for name, _ in named_tensors])

    async def _read(self, name: str, truncate_size: int) -> list[Any]:
        # SGLang's models: the parameter's first rows, as float32 lists.
        self.check_held()
        param = dict(self.hf.model.named_parameters())[name]
        return param[:truncate_size].detach().float().tolist()

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        return self.loop.run_until_complete(self._read(name, truncate_size))

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:
        if not self.session:
            return False, OUTSIDE_SESSION.format("update_weights_from_tensor")
        if self.refuse_loads:
            return False, "Failed to update weights: shape mismatch."
        self.loop.run_until_complete(self._update(named_tensors, flush_cache))
        return True, "Succeeded to update model weights."

    # SGLang 0.5.23's weight-update session (scheduler_components/weight_updater.py): every
    # update answers (False, ...) outside one; begin inside one, or end outside, too.
    def begin_weight_update(self, selector: str = "all") -> tuple[bool, str]:
        if self.session:
            return False, SESSION_OPEN
        self.session = True
        return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        if not self.session:
            return False, NO_SESSION
        self.session = False
        return True, "Success"

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        """SGLang's ModelRunner: the one TP rank joins as rank_offset + 0, through
        `init_custom_process_group` over ``tcp://`` (ours, `custom_group`, the same steps);
        a failure is answered, not raised."""
        assert group_name != "", "Group name cannot be empty"
        try:
            self.groups[group_name] = custom_group(
                backend,
                world_size,
                rank_offset,
                group_name,
                self.group_timeout,
                init_method=f"tcp://{master_address}:{master_port}",
            )
            return True, "Succeeded to initialize custom process group."
        except Exception as e:
            return False, f"Failed to initialize custom process group: {e}."

    def destroy_weights_update_group(self, group_name: str) -> tuple[bool, str]:
        if group_name not in self.groups:
            return False, "The group to be destroyed does not exist."
        dist.destroy_process_group(self.groups.pop(group_name))
        return True, "Succeeded to destroy custom process group."

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> tuple[bool, str]:
        """SGLang 0.5.23: inside a session only; one broadcast per name from rank 0 into
        ``torch.empty(shape, dtype)`` (async, then all waited), then the model's loader."""
        if not self.session:
            return False, OUTSIDE_SESSION.format("update_weights_from_distributed")
        try:
            assert group_name in self.groups, (
                f"Group {group_name} not in {list(self.groups)}. "
                "Please call `init_weights_update_group` first."
            )
            weights, handles = [], []
            for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
                if i == self.break_at:  # the group breaks under it, mid-broadcast
                    dist.destroy_process_group(self.groups.pop(group_name))
                    raise RuntimeError("Connection closed by peer")
                weight = torch.empty(shape, dtype=getattr(torch, dtype))
                group = self.groups[group_name]
                handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
                weights.append((name, weight))
            for handle in handles:
                handle.wait()
        except Exception as e:
            return False, f"Failed to receive weights: {e}"
        self.loop.run_until_complete(self._update(weights, flush_cache))
        return True, "Succeeded to update parameter online."

    def shutdown(self) -> None:
        self.shut_down_on = threading.current_thread().name

    async def _occupation(self, release: bool) -> None:
        self.occupation.append("release" if release else "resume")
        if not self.server_args.get("enable_memory_saver"):
            return  # SGLang's memory saver is a no-op then: the memory stays held
        if release:
            self.hf.release_memory()
        else:
            self.hf.resume_memory()

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Frees the weights (and KV cache) with ``enable_memory_saver``, else nothing; then an
        update into them fails, as a generation does."""
        self.loop.run_until_complete(self._occupation(release=True))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.loop.run_until_complete(self._occupation(release=False))


def sglang_modules(
    engine: Callable[..., Any] = StandInSGLangEngine, version: str = SGLANG_FLOOR
) -> dict[str, ModuleType]:
    """`sys.modules` entries for ``sglang`` (`engine` builds `sglang.Engine`, ``__version__``
    `version`) and the two submodules the continuous adapter reads its control calls from."""
    sglang = ModuleType("sglang")
    sglang.Engine = engine  # type: ignore[attr-defined]
    sglang.__version__ = version  # type: ignore[attr-defined]
    io = ModuleType("sglang.srt.managers.io_struct")
    io.PauseGenerationReqInput = lambda mode: SimpleNamespace(mode=mode)  # type: ignore[attr-defined]
    io.ContinueGenerationReqInput = SimpleNamespace  # type: ignore[attr-defined]
    io.UpdateWeightsFromTensorReqInput = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    io.GetWeightsByNameReqInput = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    io.BeginWeightUpdateReqInput = lambda selector="all": SimpleNamespace(selector=selector)  # type: ignore[attr-defined]
    io.EndWeightUpdateReqInput = SimpleNamespace  # type: ignore[attr-defined]
    utils = ModuleType("sglang.srt.utils")
    serializer = SimpleNamespace(serialize=lambda pairs: pairs)
    utils.MultiprocessingSerializer = serializer  # type: ignore[attr-defined]
    return {"sglang": sglang, "sglang.srt.managers.io_struct": io, "sglang.srt.utils": utils}
