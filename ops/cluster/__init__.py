"""Configs of a 3-node NATS JetStream cluster: the examples in this folder, and how to write others.

    python -m ops.cluster                                # print the three configs (one machine)
    python -m ops.cluster --out DIR                      # write DIR/node1.conf .. node3.conf
    python -m ops.cluster --hosts 10.0.0.1,10.0.0.2,10.0.0.3 --out DIR   # one node per machine

`node1.conf` .. `node3.conf` here are the output of `python -m ops.cluster --out ops/cluster`
(a test keeps them so). They are written by `bus.embedded.server_config`, the function that
configures the tests' `EmbeddedCluster`, so what users run is what the tests run.
"""

from __future__ import annotations

from collections.abc import Sequence

from bus.embedded import CLUSTER_NAME, LOOPBACK, ClusterMember, NodeAddress, server_config

CLIENT_PORT = 4222
CLUSTER_PORT = 6222
HTTP_PORT = 8222
DEFAULT_HOSTS = (LOOPBACK,) * 3
STORE = "nats-data"
EXAMPLES = "ops/cluster"
"""Where the example configs live, relative to the repository root
(the --out they were written with)."""

HEADER = """\
# Node {name} of a {size}-node jetrl NATS JetStream cluster (cluster name "{cluster_name}").
# Written by `python -m ops.cluster{args}`. Start it with
#     nats-server -c {path}
# (its store directory below is relative to where you start it). Replicate a run's streams with
#     python -m ops.streams apply --run R --replicas 3 --nats {urls}
"""

SECURITY = """\
# --- Credentials ------------------------------------------------------------------------
# Per-role users (nkeys) with publish/subscribe permissions for one run:
#     python -m ops.streams users --run R --out DIR
# writes DIR/users.conf (public keys only) and a seed per role, DIR/<role>.nk (mode 600).
# Put users.conf beside this file, uncomment (the path is relative to this file), and give
# each worker its own seed file, e.g. --identity DIR/rollout.nk (never a password in a URL).
# include "users.conf"
#
# --- TLS (on any network you do not trust) ----------------------------------------------
# Clients: bus.connection.connect(url, name, tls=ssl_context, tls_hostname="<name in the cert>"),
# with ssl.create_default_context(cafile="ca.pem") as the context.
# tls {
#   cert_file: "/etc/jetrl/nats/server-cert.pem"
#   key_file: "/etc/jetrl/nats/server-key.pem"
#   # Require client certificates (mutual TLS) signed by this CA:
#   # ca_file: "/etc/jetrl/nats/ca.pem"
#   # verify: true
#   timeout: 2
# }
# Replication between nodes travels on the routes: encrypt it with the same block placed
# inside `cluster { ... }` above, with a ca_file and `verify: true` so only nodes holding
# a certificate of your CA can join.
"""


def node_addresses(
    hosts: Sequence[str],
    client_port: int = CLIENT_PORT,
    cluster_port: int = CLUSTER_PORT,
    http_port: int = HTTP_PORT,
) -> list[NodeAddress]:
    """One address per host; nodes that share a host get consecutive ports so they do not
    collide."""
    shared = len(set(hosts)) < len(hosts)
    return [
        NodeAddress(
            f"n{i + 1}",
            host,
            *(port + i * shared for port in (client_port, cluster_port, http_port)),
        )
        for i, host in enumerate(hosts)
    ]


def node_configs(
    hosts: Sequence[str] = DEFAULT_HOSTS, out: str | None = None, store: str = STORE
) -> dict[str, str]:
    """File name -> config text of every node of a cluster on `hosts`,
    as `python -m ops.cluster` writes them."""
    addresses = node_addresses(hosts)
    args = "".join(
        f" {flag} {value}"
        for flag, value, default in (
            ("--hosts", ",".join(hosts), ",".join(DEFAULT_HOSTS)),
            ("--out", out, None),
            ("--store", store, STORE),
        )
        if value != default
    )
    configs = {}
    for i, address in enumerate(addresses):
        filename = f"node{i + 1}.conf"
        header = HEADER.format(
            name=address.name,
            size=len(addresses),
            cluster_name=CLUSTER_NAME,
            args=args,
            path=f"{out}/{filename}" if out else filename,
            urls=",".join(a.url for a in addresses),
        )
        member = ClusterMember(
            address, tuple(peer for peer in addresses if peer != address), CLUSTER_NAME
        )
        configs[filename] = header + server_config(
            f"{store}/{address.name}", address.host, address.client_port, member, SECURITY
        )
    return configs
