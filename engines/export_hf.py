"""One HF state dict of full tensors + the model directory it was trained from -> a Hugging Face
model directory that `AutoModelForCausalLM` / `AutoTokenizer` load.

    config      the model directory's `AutoConfig`, its `dtype` set to the export's
    model       built from the config on the meta device (no random init, no second copy of
                the weights), the state dict assigned into it (checked first: every name and
                shape the model has, nothing else; a tied output weight re-tied), then
                `save_pretrained`: safetensors shards (+ an index past `max_shard_size`)
    generation  the model directory's generation_config.json, when it has one
    tokenizer   `AutoTokenizer.from_pretrained(model dir).save_pretrained`: the tokenizer files
                and the chat template (transformers writes it as chat_template.jinja)

Everything is written into a temporary sibling of the output directory, which is renamed into
place at the end: a failed export leaves no half-written directory under the name asked for.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engines.export import ExportError, Progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_out_dir(out: Path, force: bool) -> None:
    """ExportError for an output path that is a file, or a non-empty directory without --force."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out}: exists and is not empty (--force replaces it)")


def _checked(
    state: dict[str, torch.Tensor], model: torch.nn.Module, tied: bool
) -> dict[str, torch.Tensor]:
    """`state` against the model's own names and shapes; ExportError at the first mismatch."""
    want = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if tied:
        want.pop("lm_head.weight", None)
    missing = sorted(want.keys() - state.keys())
    unknown = sorted(state.keys() - want.keys())
    if missing or unknown:
        raise ExportError(
            f"the checkpoint does not fit the model's config: {len(missing)} missing "
            f"(e.g. {missing[:1]}), {len(unknown)} unknown (e.g. {unknown[:1]}); was the run's "
            "model another? (--model)"
        )
    for name, shape in want.items():
        if tuple(state[name].shape) != shape:
            raise ExportError(
                f"the checkpoint does not fit the model's config: {name} is "
                f"{tuple(state[name].shape)}, the config makes it {shape}; was the run's model "
                "another? (--model)"
            )
    return state


def write_hf(
    state: dict[str, torch.Tensor],
    model_dir: Path,
    out: Path,
    *,
    dtype: torch.dtype = torch.float32,
    force: bool = False,
    max_shard_size: str = "5GB",
    progress: Progress = lambda line: None,
) -> list[Path]:
    """Write `state` (HF names, full tensors) as a HF model directory `out`, with the config,
    generation config, tokenizer and chat template of `model_dir`; returns the files written."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    check_out_dir(out, force)
    config = AutoConfig.from_pretrained(model_dir)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    cast = {name: t.to(dtype) for name, t in _checked(state, model, tied).items()}
    model.load_state_dict(cast, strict=False, assign=True)
    if tied:
        model.tie_weights()
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise ExportError(f"the checkpoint left {len(left)} parameters unset, e.g. {left[0]}")
    model.config.dtype = dtype
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    tmp = out.with_name(f".{out.name}.export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed export's leftovers
    size = sum(t.numel() * t.element_size() for t in cast.values())
    progress(f"writing {len(cast)} tensors, {size / 1e9:.2f} GB as {str(dtype)[6:]} safetensors")
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        progress("writing the tokenizer and chat template")
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sorted(p for p in out.iterdir() if p.is_file())
