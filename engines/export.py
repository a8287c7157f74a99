"""A trainer checkpoint of any engine -> one Hugging Face state dict of full tensors.

What each engine leaves in `trainer.checkpoint_dir` (only its last checkpoint: each save
replaces the one before), and how it is read back here, on one CPU process with no group:

    torch     rank0.pt                 {"model": the HF model's state_dict, "step", ...}
                                       (memory-mapped: the optimizer state is never read)
    fsdp      fsdp.pt                  pointer {"dir", "step", "world_size"}
              fsdp.pt.d/step-N/        DCP: every rank's Shard(0) rows of every tensor; DCP's
                                       metadata knows each tensor's full shape, so each full
                                       tensor is allocated and DCP fills it from all the
                                       ranks' files (`dcp.load(no_dist=True)`), in batches
    megatron  megatron.pt              pointer {"dir", "step", "tensor_parallel_size",
                                       "pipeline_parallel_size"}
              megatron.pt.d/step-N/    rank{R}.pt, R = pp_rank x tp + tp_rank: that rank's
                                       GPTModel state_dict (its stage's layers renumbered from
                                       0, its tensor-parallel cut); per stage the cuts are
                                       merged (`megatron_names.merge`), the stages joined
                                       (`unstage_params`), and the names mapped back to HF's
                                       (`megatron_to_hf`: QKV split, fc1 into gate/up, the
                                       vocabulary padding cut off)

Every pointer (and the torch file) also records `model_dir`, the model directory the trainer
loaded (config, tokenizer): what `ops.export` rebuilds the HF model from.

A tied model's output weight is the embedding: the state dict returned holds it once, under
``model.embed_tokens.weight`` (the torch engine's `lm_head.weight` copy is dropped after a check
that it is the same tensor). No bus, no stage: `ops.export` is the command around it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.megatron_config import spec_from_hf
from engines.megatron_names import megatron_to_hf, merge, unstage_params

POINTERS = {"torch": "rank0.pt", "fsdp": "fsdp.pt", "megatron": "megatron.pt"}
"""Engine -> the file whose presence says its checkpoint is committed in the directory."""
BATCH_BYTES = 1 << 30
"""Bytes of full tensors read from a DCP checkpoint per `dcp.load` (one progress line each)."""

Progress = Callable[[str], None]


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message is one line naming the cause."""


@dataclass(frozen=True)
class Checkpoint:
    """The committed checkpoint in one directory, as its pointer describes it."""

    engine: str
    directory: Path
    step: int
    model_dir: Path | None
    """The model directory the trainer loaded (None: a checkpoint older than the record)."""
    ranks: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def step_dir(self) -> Path:
        """fsdp / megatron: the committed step's directory."""
        return self.directory / f"{POINTERS[self.engine]}.d" / f"step-{self.step}"

    def describe(self) -> str:
        layout = {
            "torch": "1 rank",
            "fsdp": f"{self.ranks} ranks",
            "megatron": f"tensor x pipeline parallel {self.tensor_parallel} x "
            f"{self.pipeline_parallel}",
        }[self.engine]
        return f"{self.engine} checkpoint of step {self.step} ({layout}) in {self.directory}"


def _load(path: Path) -> Any:
    """A torch.save file, memory-mapped (only the tensors used are read), CPU, plain data only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise ExportError(f"{path}: missing (the checkpoint is incomplete)") from None
    except Exception as exc:  # a truncated or foreign file: say which, in one line
        raise ExportError(
            f"{path}: not a readable checkpoint ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]})"
        ) from None


def _model_dir(record: dict[str, Any]) -> Path | None:
    value = record.get("model_dir")
    return Path(value) if value else None


def find_checkpoint(directory: Path) -> Checkpoint:
    """The committed checkpoint in `directory`, whichever engine wrote it; ExportError if none,
    or if checkpoints of several engines are there (which one is meant is not knowable)."""
    if not directory.is_dir():
        raise ExportError(f"{directory}: no such checkpoint directory")
    found = [engine for engine, name in POINTERS.items() if (directory / name).is_file()]
    if not found:
        raise ExportError(
            f"{directory} holds no trainer checkpoint (the trainer writes one every "
            "trainer.checkpoint_every steps and at the run's end)"
        )
    if len(found) > 1:
        raise ExportError(
            f"{directory} holds checkpoints of several engines ({', '.join(found)}): "
            "move the ones not meant aside"
        )
    engine = found[0]
    record = _load(directory / POINTERS[engine])
    if engine == "torch":
        return Checkpoint(engine, directory, int(record["step"]), _model_dir(record))
    if engine == "fsdp":
        return Checkpoint(
            engine, directory, int(record["step"]), _model_dir(record), int(record["world_size"])
        )
    tp, pp = int(record["tensor_parallel_size"]), int(record.get("pipeline_parallel_size", 1))
    return Checkpoint(engine, directory, int(record["step"]), _model_dir(record), tp * pp, tp, pp)


def check_step(checkpoint: Checkpoint, step: int | None) -> None:
    """ExportError unless `step` (None: whatever is there) is the step on disk."""
    if step is not None and step != checkpoint.step:
        raise ExportError(
            f"step {step} is not on disk: steps there: {checkpoint.step} "
            f"({checkpoint.describe()}; the trainer keeps only its last checkpoint)"
        )


def hf_state_dict(
    checkpoint: Checkpoint, hf_config: Any, progress: Progress = lambda line: None
) -> dict[str, torch.Tensor]:
    """The checkpoint's model as HF parameter names -> full CPU tensors (as stored: float32
    masters). `hf_config`: the model's transformers config (megatron needs its shape to undo
    the fused and padded layouts; a tied model drops its output copy)."""
    readers = {"torch": _torch_state, "fsdp": _fsdp_state, "megatron": _megatron_state}
    state = readers[checkpoint.engine](checkpoint, hf_config, progress)
    if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" in state:
        head, embedding = state.pop("lm_head.weight"), state.get("model.embed_tokens.weight")
        if embedding is None or not torch.equal(head, embedding):
            raise ExportError(
                f"{checkpoint.describe()}: the config ties the embeddings, but lm_head.weight "
                "differs from model.embed_tokens.weight (was the run's model another?)"
            )
    return state


def _torch_state(
    checkpoint: Checkpoint, hf_config: Any, progress: Progress
) -> dict[str, torch.Tensor]:
    progress(f"reading {checkpoint.describe()}")
    state = _load(checkpoint.directory / POINTERS["torch"])
    return {name: tensor.clone() for name, tensor in state["model"].items()}


def _batches(sizes: dict[str, int], limit: int) -> Iterator[list[str]]:
    """The names in order, cut into runs of at most `limit` bytes (at least one name each)."""
    batch: list[str] = []
    held = 0
    for name, size in sizes.items():
        if batch and held + size > limit:
            yield batch
            batch, held = [], 0
        batch.append(name)
        held += size
    if batch:
        yield batch


def _fsdp_state(
    checkpoint: Checkpoint, hf_config: Any, progress: Progress
) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    step_dir = checkpoint.step_dir
    try:
        metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    except FileNotFoundError:
        raise ExportError(f"{step_dir}: no DCP metadata (the checkpoint is incomplete)") from None
    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            shapes[key[len("model.") :]] = (meta.size, meta.properties.dtype)
    sizes = {
        name: torch.Size(size).numel() * torch.empty(0, dtype=dtype).element_size()
        for name, (size, dtype) in shapes.items()
    }
    total, done = sum(sizes.values()), 0
    progress(f"reading {checkpoint.describe()}: {len(shapes)} tensors, {total / 1e9:.2f} GB")
    state: dict[str, torch.Tensor] = {}
    for names in _batches(sizes, BATCH_BYTES):
        part = {name: torch.empty(shapes[name][0], dtype=shapes[name][1]) for name in names}
        with warnings.catch_warnings():  # "no process group: loading in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": part}, checkpoint_id=str(step_dir), no_dist=True)
        state.update(part)
        done += sum(sizes[name] for name in names)
        progress(f"  {len(state)}/{len(shapes)} tensors, {done / 1e9:.2f} of {total / 1e9:.2f} GB")
    return state


def _megatron_state(
    checkpoint: Checkpoint, hf_config: Any, progress: Progress
) -> dict[str, torch.Tensor]:
    tp, pp = checkpoint.tensor_parallel, checkpoint.pipeline_parallel
    try:
        spec = spec_from_hf(hf_config, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    except ValueError as exc:
        raise ExportError(f"{checkpoint.describe()}: {exc}") from None
    progress(f"reading {checkpoint.describe()}: {tp * pp} rank files")
    stages: list[dict[str, torch.Tensor]] = []
    for pp_rank in range(pp):
        cuts = []
        for tp_rank in range(tp):
            rank = pp_rank * tp + tp_rank  # megatron's default order: tensor parallel fastest
            model = _load(checkpoint.step_dir / f"rank{rank}.pt")["model"]
            cuts.append({n: t for n, t in model.items() if not n.endswith("._extra_state")})
        names = cuts[0].keys()
        if any(cut.keys() != names for cut in cuts):
            raise ExportError(
                f"{checkpoint.describe()}: the tensor-parallel ranks of stage {pp_rank} hold "
                "different parameters"
            )
        stages.append({name: merge(name, [cut[name] for cut in cuts]) for name in names})
        progress(f"  stage {pp_rank + 1}/{pp}: {len(names)} tensors merged over {tp} ranks")
    try:
        return megatron_to_hf(unstage_params(stages, spec), spec)
    except ValueError as exc:
        raise ExportError(f"{checkpoint.describe()}: {exc}") from None
