"""`python -m schemas.export DIR`: write the JSON Schema of every event type into DIR."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from schemas.codec import REGISTRY


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m schemas.export", description=__doc__)
    parser.add_argument("dir", type=Path, help="output directory (created if missing)")
    out: Path = parser.parse_args(argv).dir
    out.mkdir(parents=True, exist_ok=True)
    for type_name, cls in sorted(REGISTRY.items()):
        path = out / f"{type_name}.v{cls.VERSION}.json"
        path.write_text(json.dumps(cls.model_json_schema(), indent=2, sort_keys=True) + "\n")
        print(path)


if __name__ == "__main__":
    main()
