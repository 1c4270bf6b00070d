"""Which cluster a command talks to, and as whom: the global flags, then the environment, then
what `belayer up` recorded in the state folder.

- URL: --nats, $BELAYER_NATS_URL, `<state-dir>/nats.url`.
- Cluster id: --cluster-id, $BELAYER_CLUSTER_ID, the local cluster's (cluster.json), "default".
- Credentials: --nats-creds, $BELAYER_NATS_CREDS, the local cluster's `creds/cli.creds`.
- TLS: --nats-ca, --nats-cert, --nats-key.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import msgspec

from belayer_rl.shared.access import Access
from belayer_rl.shared.bus import Target
from belayer_rl.shared.config import CLUSTER_ID_ENV, NATS_CREDS_ENV, ConfigError, resolve_nats_url
from belayer_rl.shared.subjects import DEFAULT_CLUSTER, Subjects, cluster_id_ok


class Recorded(msgspec.Struct):
    """The part of `<state-dir>/cluster.json` a command needs."""

    cluster_id: str = DEFAULT_CLUSTER
    creds_dir: str = ""


def add_target_flags(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--cluster-id", default=default(None), help=f"the Belayer cluster (or ${CLUSTER_ID_ENV})"
    )
    parser.add_argument(
        "--nats-creds", type=Path, default=default(None), help=f"NATS credentials file (or ${NATS_CREDS_ENV})"
    )
    parser.add_argument(
        "--nats-ca", type=Path, default=default(None), help="CA of the NATS server's TLS certificate"
    )
    parser.add_argument(
        "--nats-cert", type=Path, default=default(None), help="client certificate for NATS TLS"
    )
    parser.add_argument("--nats-key", type=Path, default=default(None), help="key of the client certificate")


def recorded(state_dir: Path) -> Recorded:
    path = state_dir / "cluster.json"
    if not path.exists():
        return Recorded()
    try:
        return msgspec.json.decode(path.read_bytes(), type=Recorded)
    except msgspec.DecodeError:
        return Recorded()  # a cluster.json being rewritten: the defaults, as with no local cluster


def cluster_id_of(args: argparse.Namespace, fallback: str = DEFAULT_CLUSTER) -> str:
    """--cluster-id, else $BELAYER_CLUSTER_ID, else `fallback`; refused if it is no cluster id."""
    cluster_id = args.cluster_id or os.environ.get(CLUSTER_ID_ENV) or fallback
    if not cluster_id_ok(cluster_id):
        raise ConfigError(
            f"--cluster-id {cluster_id!r} is not a cluster id (lowercase letters, digits, - and _)"
        )
    return cluster_id


def resolve_target(args: argparse.Namespace, *, role: str = "cli") -> Target:
    local = recorded(args.state_dir)
    cluster_id = cluster_id_of(args, local.cluster_id)
    creds = args.nats_creds or (Path(env) if (env := os.environ.get(NATS_CREDS_ENV)) else None)
    if creds is None and local.creds_dir and (Path(local.creds_dir) / f"{role}.creds").exists():
        creds = Path(local.creds_dir) / f"{role}.creds"
    if (args.nats_cert is None) != (args.nats_key is None):
        raise ConfigError("--nats-cert and --nats-key go together")
    access = Access(creds=creds, ca=args.nats_ca, cert=args.nats_cert, key=args.nats_key)
    return Target(resolve_nats_url(args.nats, args.state_dir), Subjects(cluster_id), access)
