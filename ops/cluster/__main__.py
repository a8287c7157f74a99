"""`python -m ops.cluster [--hosts H1,H2,H3] [--out DIR] [--store DIR]`:
write a 3-node cluster's configs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ops.cluster import DEFAULT_HOSTS, STORE, node_configs


def hosts_arg(value: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in value.split(",") if h.strip())
    if len(hosts) not in (3, 5):
        raise argparse.ArgumentTypeError(
            f"give 3 or 5 comma-separated hosts (a quorum survives one loss), got {len(hosts)}"
        )
    return hosts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ops.cluster", description=__doc__)
    parser.add_argument(
        "--hosts",
        type=hosts_arg,
        default=DEFAULT_HOSTS,
        help="one host per node, comma separated (default: three nodes on 127.0.0.1)",
    )
    parser.add_argument(
        "--out", help="directory to write node1.conf ... into (default: print them)"
    )
    parser.add_argument(
        "--store", default=STORE, help="JetStream store root; each node uses STORE/<node name>"
    )
    args = parser.parse_args(argv)
    configs = node_configs(args.hosts, args.out, args.store)
    if args.out is None:
        for filename, text in configs.items():
            print(f"# ===== {filename} =====\n{text}")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for filename, text in configs.items():
        (out / filename).write_text(text)
    print(f"wrote {', '.join(str(out / f) for f in configs)}", file=sys.stderr)


if __name__ == "__main__":
    main()
