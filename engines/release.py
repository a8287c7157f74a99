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

`Offload` is the HF engine's release: every storage of the module's parameters and buffers
copied off and resized to 0 bytes, then back. On a GPU the copy goes to host memory and
the CUDA cache is emptied. On the CPU the device *is* the host: the only honest release is
to let the bytes leave the process, so they go to an unlinked temporary file (the kernel's
page cache may keep them, outside this process) and glibc is asked to return the freed pages
(``malloc_trim``): the process's resident memory drops by the weights' size
(`tests/test_release.py` measures it: 60.1 MiB of weights, 60.3-60.6 MiB less resident;
without ``malloc_trim`` it did not drop at all, the freed blocks staying in glibc's heap).
Storages, not tensors: tied weights and views share one storage, freed and refilled once,
and every tensor over it sees the refill. A storage that cannot be resized (the weights left
in the checkpoint's memory map by ``from_pretrained``) is first given a copy of its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import tempfile
import threading

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


def return_freed_pages() -> None:
    """Ask glibc to give freed heap pages back to the OS (``malloc_trim(0)``): a freed block
    below its mmap threshold stays in the heap, resident, until then. Nothing elsewhere."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


class Offload:
    """`module`'s parameter and buffer storages moved off its device and back (see the module
    doc). Not thread-safe: the engine calls it between generations."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.freed: list[tuple[torch.UntypedStorage, int]] = []
        """Each freed storage and its size in bytes; empty while held."""
        self.spill: io.BufferedRandom | None = None
        """CPU: the file the bytes went to, in `freed`'s order."""
        self.host: list[torch.Tensor] = []
        """GPU: the host copy of each freed storage, in `freed`'s order."""

    @property
    def released(self) -> bool:
        return bool(self.freed)

    def own_storages(self) -> None:
        """Give every tensor over a storage that cannot be resized (a checkpoint's memory map,
        which ``from_pretrained`` may leave the weights in) a copy of its own that can, shared
        as the original was."""
        fresh: dict[int, torch.UntypedStorage] = {}
        for tensor in [*self.module.parameters(), *self.module.buffers()]:
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
        """The distinct non-empty storages under the module's parameters and buffers."""
        seen: dict[int, torch.UntypedStorage] = {}
        tensors = [*self.module.parameters(), *self.module.buffers()]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.device.type != "meta":
                seen.setdefault(storage.data_ptr(), storage)
        return list(seen.values())

    def held_bytes(self) -> int:
        """Bytes of the module's storages on its device now (0 once released)."""
        return 0 if self.released else sum(s.nbytes() for s in self.storages())

    def release(self) -> None:
        """Copy every storage off the device, then free it. Releasing twice does nothing."""
        if self.released:
            return
        self.own_storages()
        storages = self.storages()
        if storages and storages[0].device.type == "cpu":
            self.spill = tempfile.TemporaryFile(prefix="jetrl-offload-")
            for storage in storages:
                self.spill.write(host_buffer(storage))
            self.spill.flush()
        else:
            host = [byte_view(s).to("cpu", copy=True) for s in storages]
            self.host = [h.pin_memory() for h in host] if torch.cuda.is_available() else host
        self.freed = [(storage, storage.nbytes()) for storage in storages]
        for storage in storages:
            storage.resize_(0)
        if self.spill is not None:
            return_freed_pages()
        elif torch.cuda.is_available():
            torch.cuda.empty_cache()

    def resume(self) -> None:
        """Allocate every freed storage again and copy its bytes back. Resuming a held module
        does nothing."""
        if not self.released:
            return
        if self.spill is not None:
            self.spill.seek(0)
        for index, (storage, size) in enumerate(self.freed):
            storage.resize_(size)
            if self.spill is not None:
                read = self.spill.readinto(host_buffer(storage))
                if read != size:
                    raise OSError(f"offload: {read} of {size} bytes read back from the spill file")
            else:
                byte_view(storage).copy_(self.host[index])
        if self.spill is not None:
            self.spill.close()
        self.freed, self.spill, self.host = [], None, []
