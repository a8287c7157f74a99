"""A rollout engine's device memory given back between phases (`placement: colocated`), and
the weights that arrive meanwhile. Used by the real engines' `ReleasableEngine` calls:

    release_memory: the engine's own call (vLLM ``sleep(level=1)``, SGLang
        ``release_memory_occupation``, HF: `Offload.release`) -> released
    load_state_dict while released: the names checked at once (KeyError), the tensors copied
        and kept on the host in `Deferred` (a later version's tensor replaces an earlier one's
        of the same name), `version` taken
    resume_memory: the engine's own call (``wake_up``, ``resume_memory_occupation``,
        `Offload.resume`) -> the deferred tensors loaded as one load and read back
        (`WeightsNotLoaded` raised from `resume_memory` when they do not read back)

Why defer: while released, the engine's weights are not on the device (vLLM and SGLang unmap
them; the HF engine's storages have size 0), so writing into them would fault or be lost;
and the trainer holds the device then. The rollout worker loads each new version when it
arrives, in any phase (`consumers.rollout.watch_weights`): the deferred tensors are the ones
that changed since the version the engine last loaded, so their union (newest per name) is
exactly what the engine lacks for the newest version.

`Offload` is the HF engine's release, and the torch train engine's release of its optimizer
state (`trainer.offload_optimizer`): every storage under a set of tensors (a module's
parameters and buffers: `Offload.of_module`; an optimizer's state) copied off and resized to
0 bytes, then back. On a GPU the copy goes to host memory and the CUDA cache is emptied. On
the CPU the device *is* the host: the only honest release is to let the bytes leave the
process, so they go to an unlinked temporary file (the kernel's page cache may keep them,
outside this process) and glibc is asked to return the freed pages (``malloc_trim``): the
process's resident memory drops by the weights' size (`tests/test_release.py` measures it:
60.1 MiB of weights, 60.3-60.6 MiB less resident; without ``malloc_trim`` it did not drop at
all, the freed blocks staying in glibc's heap), or by the optimizer state's.
Storages, not tensors: tied weights and views share one storage, freed and refilled once,
and every tensor over it sees the refill. A storage that cannot be resized (the weights left
in the checkpoint's memory map by ``from_pretrained``) is first given a copy of its own. Each
storage goes by its own device: a CPU one to the file, any other to host memory (AdamW keeps
its `step` counters on the CPU beside moments on the GPU; the train engine offers only those
on its device).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import tempfile
import threading
from collections.abc import Callable, Iterable

import torch


class Deferred:
    """Weights loaded while the engine's memory is released, to load on resume, and the lock
    the engine holds around its release, its resume and every load: the rollout worker loads
    a version from its weights watcher's thread while the phase's thread may be releasing or
    resuming (`consumers.rollout_copies.load` beside `consumers.colocation.Phases.leave`); a
    load that saw the memory held and wrote after it was freed would fault."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.lock = threading.RLock()
        """Re-entrant: `resume_memory` loads the deferred tensors through `load_state_dict`."""

    def add(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Keep a copy of `tensors` (host tensors) of `version`. A copy: the caller's may change
        after the call (the weights receiver brings a delta chain's tensors to the next version
        in place, `engines.weight_delta.apply_delta`), and a resume must load this version's
        bytes. It costs host memory for the changed tensors while the engine is released."""
        self.tensors.update({name: tensor.clone() for name, tensor in tensors.items()})
        self.version = version

    def take(self) -> tuple[dict[str, torch.Tensor], int] | None:
        """What to load now (and forget), or None when nothing arrived."""
        if self.version is None:
            return None
        taken = (self.tensors, self.version)
        self.tensors, self.version = {}, None
        return taken


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype | None) -> int:
    """Bytes of `model`'s parameters (a meta-device skeleton's too) in `dtype` (None: their
    own)."""
    return sum(
        p.numel() * (p.element_size() if dtype is None else dtype.itemsize)
        for p in model.parameters()
    )


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """[nbytes] uint8 over the whole of `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def host_buffer(storage: torch.UntypedStorage) -> ctypes.Array[ctypes.c_char]:
    """A CPU storage's bytes as a writable buffer for file I/O (no copy). Not `numpy()`: torch
    marks a storage shared with numpy as never to be resized again."""
    return (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())


def optimizer_state(
    optimizers: Iterable[torch.optim.Optimizer], device: torch.device
) -> list[torch.Tensor]:
    """Every tensor of the optimizers' state on `device`'s type (AdamW's exp_avg, exp_avg_sq
    and its step counters where they are kept there: on the CPU, or with `capturable`): none
    before the first step, which creates them."""
    return [
        value
        for optimizer in optimizers
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.device.type == device.type
    ]


def return_freed_pages() -> None:
    """Ask glibc to give freed heap pages back to the OS (``malloc_trim(0)``): a freed block
    below its mmap threshold stays in the heap, resident, until then. Nothing elsewhere."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class Offload:
    """The storages under `tensors()` moved off their device and back (see the module doc).
    `tensors` is asked again at each release: what it names may change between two (an
    optimizer creates its state at its first step, and a checkpoint load replaces it). Not
    thread-safe: the engine calls it between generations, or between steps."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        self.tensors = tensors
        self.freed: list[tuple[torch.UntypedStorage, int]] = []
        """Each freed storage and its size in bytes; empty while held."""
        self.spill: io.BufferedRandom | None = None
        """The file the CPU storages' bytes went to, in `freed`'s order."""
        self.host: list[torch.Tensor | None] = []
        """The host copy of each freed storage off the CPU (None for a spilled one), in
        `freed`'s order."""

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> Offload:
        """`module`'s parameters and buffers."""
        return cls(lambda: [*module.parameters(), *module.buffers()])

    @property
    def released(self) -> bool:
        return bool(self.freed)

    def own_storages(self) -> None:
        """Give every tensor over a storage that cannot be resized (a checkpoint's memory map,
        which ``from_pretrained`` may leave the weights in) a copy of its own that can, shared
        as the original was."""
        fresh: dict[int, torch.UntypedStorage] = {}
        for tensor in self.tensors():
            storage = tensor.untyped_storage()
            if storage.resizable() or not storage.nbytes() or storage.device.type == "meta":
                continue
            key = storage.data_ptr()
            if key not in fresh:
                copy = torch.empty(storage.nbytes(), dtype=torch.uint8, device=storage.device)
                fresh[key] = copy.copy_(byte_view(storage)).untyped_storage()
            over = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
            over.set_(fresh[key], tensor.storage_offset(), tensor.shape, tensor.stride())
            tensor.data = over

    def storages(self) -> list[torch.UntypedStorage]:
        """The distinct non-empty storages under `tensors()`."""
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in self.tensors():
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.device.type != "meta":
                seen.setdefault(storage.data_ptr(), storage)
        return list(seen.values())

    def held_bytes(self) -> int:
        """Bytes of the storages on their device now (0 once released)."""
        return 0 if self.released else sum(s.nbytes() for s in self.storages())

    def release(self) -> int:
        """Copy every storage off its device, then free it; the bytes freed. Releasing twice
        does nothing, and so does releasing when `tensors()` has no storage (an optimizer
        before its first step): 0."""
        if self.released:
            return 0
        self.own_storages()
        storages = self.storages()
        spilled = [s for s in storages if s.device.type == "cpu"]
        if spilled:
            self.spill = tempfile.TemporaryFile(prefix="jetrl-offload-")
            for storage in spilled:
                self.spill.write(host_buffer(storage))
            self.spill.flush()
        pin = torch.cuda.is_available()
        self.host = [
            None if s.device.type == "cpu" else off_device(byte_view(s), pin) for s in storages
        ]
        self.freed = [(storage, storage.nbytes()) for storage in storages]
        for storage in storages:
            storage.resize_(0)
        if spilled:
            return_freed_pages()
        if len(spilled) < len(storages) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return sum(size for _, size in self.freed)

    def resume(self) -> int:
        """Allocate every freed storage again and copy its bytes back; the bytes allocated.
        Resuming what is held does nothing: 0."""
        if not self.released:
            return 0
        if self.spill is not None:
            self.spill.seek(0)
        for (storage, size), host in zip(self.freed, self.host, strict=True):
            storage.resize_(size)
            if host is not None:
                byte_view(storage).copy_(host)
                continue
            assert self.spill is not None, "a CPU storage freed without its spill file"
            read = self.spill.readinto(host_buffer(storage))
            if read != size:
                raise OSError(f"offload: {read} of {size} bytes read back from the spill file")
        if self.spill is not None:
            self.spill.close()
        moved = sum(size for _, size in self.freed)
        self.freed, self.spill, self.host = [], None, []
        return moved


def off_device(data: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `data` (pinned when `pin`: a CUDA machine copies it back faster)."""
    host = data.to("cpu", copy=True)
    return host.pin_memory() if pin else host
