"""A `.gguf` file as a Hugging Face model directory: dequantised once, then cached.

llama.cpp's GGUF files are how many small instruct models ship (one file: weights, often
quantised, config, tokenizer, chat template). The workers load Hugging Face directories, so
`model.path` naming a `.gguf` file is converted first (`engines.model_source` calls
`converted_dir`, so every worker sees the same directory):

    file -> key (its resolved path, size and mtime) -> <cache>/<stem>-<key> exists? use it
         -> else, under a lock file (one converter per node, the others wait for it):
            config from the GGUF metadata -> a fresh model built from it (`from_config`, on the
            CPU: no accelerate) -> the tensors dequantised by transformers' GGUF reader
            (`load_gguf_checkpoint`, which also undoes llama.cpp's q/k permutation) loaded
            into it (strict: only tied weights may be absent) -> `save_pretrained` into a
            temporary directory beside the cache entry, with the tokenizer (and its chat
            template) read from the same file -> renamed into place (atomic: a reader sees
            a whole directory or none)

Why not `from_pretrained(dir, gguf_file=...)`: transformers wants accelerate for it, and the
model it returns is marked as quantised with gguf, so `save_pretrained` refuses it. The model
built here is a plain one, in float32 (what the dequantised values are).

The cache is `$XDG_CACHE_HOME/jetrl/gguf` (default ~/.cache/jetrl/gguf), per node; a file
changed in place (another size or mtime) gets a new entry. `python -m ops.convert_model` runs
the same conversion into a directory of one's choice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

SOURCE_FILE = "jetrl-gguf.json"
"""Written into a converted directory: which file (path, size, mtime) it came from."""


class GgufError(RuntimeError):
    """The file cannot be converted (not GGUF, an architecture transformers cannot read, the
    `gguf` package missing)."""


def cache_root() -> Path:
    """Where converted files go: ``$XDG_CACHE_HOME/jetrl/gguf`` (~/.cache/jetrl/gguf)."""
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "jetrl" / "gguf"


def source_key(file: Path) -> str:
    """16 hex digits naming `file` as it is now: its resolved path, size and mtime (ns). Cheap
    (no read of a multi-GB file), and any rewrite of the file changes it."""
    stat = file.stat()
    text = f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def converted_dir(file: str | Path, cache: Path | None = None) -> Path:
    """The Hugging Face directory of GGUF `file`, converted now unless cached (`cache`: the
    cache root, default `cache_root()`). Safe to call from many processes at once."""
    source = Path(file).expanduser().resolve()
    if not source.is_file():
        raise GgufError(f"GGUF file {str(file)!r} does not exist")
    root = cache or cache_root()
    target = root / f"{source.stem}-{source_key(source)}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{target.name}.lock"):
        if not (target / "config.json").is_file():  # converted by another process meanwhile?
            convert(source, target)
    return target


def convert(file: Path, out: Path) -> Path:
    """Write GGUF `file` as a Hugging Face directory `out` (which must not exist yet): config,
    float32 safetensors weights, tokenizer with its chat template, and `SOURCE_FILE`. Written
    into a temporary directory beside `out`, renamed to it when whole."""
    if out.exists():
        raise GgufError(f"{out} exists already: convert into a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write(file, temp)
        temp.chmod(0o755)  # mkdtemp's 0700 would hide it from the node's other users
        temp.rename(out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return out


def _write(file: Path, out: Path) -> None:
    """The conversion itself (see the module doc), into the existing directory `out`."""
    try:
        import gguf  # noqa: F401 - transformers reads GGUF through it
    except ImportError:
        raise GgufError(
            f"model.path {str(file)!r} is a GGUF file: install the `gguf` package to read it "
            "(pip install 'jetrl[gguf]')"
        ) from None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        parsed = load_gguf_checkpoint(str(file), return_tensors=False)
    except Exception as exc:  # noqa: BLE001 - whatever the reader says, one line naming the file
        detail = " ".join(str(exc).split())[:300]
        raise GgufError(f"{file}: not a GGUF file transformers can read: {detail}") from None
    settings = {k: v for k, v in parsed["config"].items() if not k.startswith("_")}
    model_type = settings.pop("model_type", None)
    if model_type is None:
        raise GgufError(f"{file}: its GGUF metadata names no architecture")
    config = AutoConfig.for_model(model_type, **settings)
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    tensors = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = set(_tied_names(model))
    missing = [name for name in result.missing_keys if name not in tied]
    if missing or result.unexpected_keys:
        raise GgufError(
            f"{file}: its tensors do not fit a {model_type} model: missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    tokenizer.save_pretrained(out)
    stat = file.stat()
    (out / SOURCE_FILE).write_text(
        json.dumps(
            {"file": str(file), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}, indent=1
        )
    )


def _tied_names(model: object) -> Iterator[str]:
    """Parameter names that are tied to another (absent from a GGUF file: `lm_head.weight`
    when the embeddings are tied)."""
    import torch

    assert isinstance(model, torch.nn.Module)
    seen: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            yield name
        seen.setdefault(id(param), name)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if absent) while inside; released on exit, and by
    the kernel should the process die."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
