"""`belayer creds`: every role's credential and the nats-server permissions of a cluster, made from
the services' declarations; `--revoke` gives one user a new key."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from belayer_rl.cli.target import cluster_id_of
from belayer_rl.cli.up import pid_alive, read_cluster
from belayer_rl.services import SERVICES
from belayer_rl.shared.access import AccessError
from belayer_rl.shared.roles import Credentials, compose_owners
from belayer_rl.shared.subjects import DEFAULT_CLUSTER, Subjects, cluster_id_ok


def cmd_creds(args: argparse.Namespace) -> int:
    if args.revoke:
        running = read_cluster(args.state_dir.resolve())
        return revoke(
            args, cluster_id_of(args, running.cluster_id if running is not None else DEFAULT_CLUSTER)
        )
    cluster_id = cluster_id_of(args)
    if args.out is None:
        print("belayer creds: --out names the folder for the new credentials", file=sys.stderr)
        return 2
    engines = tuple(e for e in args.engines.split(",") if e)
    if not all(cluster_id_ok(e) for e in engines):
        print(f"belayer creds: engine ids are lowercase letters, digits, - and _: {engines}", file=sys.stderr)
        return 2
    clients = tuple(c for c in args.clients.split(",") if c)
    if not all(cluster_id_ok(c) for c in clients):
        print(
            f"belayer creds: client names are lowercase letters, digits, - and _: {clients}", file=sys.stderr
        )
        return 2
    api_keys = tuple(k for k in args.api_keys.split(",") if k)
    try:
        written = Credentials.generate(SERVICES, Subjects(cluster_id), engines, clients, api_keys).write(
            args.out
        )
    except AccessError as exc:
        print(f"belayer creds: {exc}", file=sys.stderr)
        return 2
    print(f"cluster {cluster_id}: {args.out / 'auth.conf'} (include it from the nats-server config)")
    for name, path in written.items():
        print(f"  {name:<24} {path}")
    if args.compose_owners:
        # What no container reads (cli.creds, admin.creds, the folder) goes to whoever ran sudo:
        # the next step is their own `belayer --nats-creds creds/cli.creds ...`.
        invoker = int(os.environ.get("SUDO_UID", os.geteuid())), int(os.environ.get("SUDO_GID", os.getegid()))
        owners = compose_owners(SERVICES, args.out, engines)
        try:
            for path in [args.out, *args.out.iterdir()]:
                uid, gid = (owners[path], owners[path]) if path in owners else invoker
                os.lchown(path, uid, gid)  # a link in the folder is not followed
        except PermissionError:
            print("belayer creds --compose-owners: only root may give files to the services' uids"
                  " (run it with sudo)", file=sys.stderr)  # fmt: skip
            return 2
        print("each secret is owned by the uid of the Compose service that reads it (compose.yaml)")
    return 0


def revoke(args: argparse.Namespace, cluster_id: str) -> int:
    """A fresh key for one user, written over its `.creds` file and into auth.conf; every other
    credential stays. The local cluster's nats-server reloads at once (SIGHUP), which closes the
    revoked key's connections; another server must be told to reload."""
    running = read_cluster(args.state_dir.resolve())
    folder = args.out or (Path(running.creds_dir) if running is not None and running.creds_dir else None)
    if folder is None:
        print("belayer creds --revoke: no local cluster with credentials; name their folder with --out",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        creds = Credentials.load(SERVICES, folder, Subjects(cluster_id))
        creds.rotate(args.revoke)
    except (OSError, ValueError) as exc:
        print(f"belayer creds --revoke: {exc}", file=sys.stderr)
        return 2
    creds.write(folder)
    print(f"{args.revoke}: a new key in {folder / (args.revoke + '.creds')}; its old one is revoked")
    server = next((p for p in running.processes if p.name == "nats-server"), None) if running else None
    if args.out is None and server is not None and pid_alive(server.pid):
        os.kill(server.pid, signal.SIGHUP)
        print(
            f"nats-server (pid {server.pid}) reloaded its authorization: the old key's connections are closed"
        )
        print(f"processes of {args.revoke} reconnect with the new key when they restart")
    else:
        print("reload the nats-server that includes this auth.conf (SIGHUP; under Compose:"
              " `docker compose kill -s HUP nats`), then restart what uses the new key")  # fmt: skip
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    creds = commands.add_parser(
        "creds", help="credentials and nats-server permissions for a cluster (compose, an external NATS)"
    )
    creds.add_argument("--out", type=Path, help="folder for auth.conf and <role>.creds")
    creds.add_argument(
        "--revoke",
        metavar="USER",
        help="give USER (a role, or <role>-<engine>) a new key and refuse its old one; the folder is"
        " --out, or the local cluster's (whose nats-server then reloads at once)",
    )
    creds.add_argument(
        "--engines", default="e0,e1", help="engine ids, each with its own credential (default e0,e1)"
    )
    creds.add_argument(
        "--clients",
        default="",
        help="names of further rollout-side users (cli-<name>.creds): each follows and cancels only"
        " the requests it started (default: one, cli)",
    )
    creds.add_argument(
        "--api-keys",
        default="default",
        help="names of the gateway's API keys (api-key-<name>; the gateway reads only their digests,"
        " api-keys.json); a name that has a key keeps it (default: default)",
    )
    creds.add_argument(
        "--compose-owners",
        action="store_true",
        help="give each secret to the uid of the compose.yaml service that reads it (needs root)",
    )
    creds.set_defaults(run=cmd_creds)
