"""`belayer compose-file`: compose.yaml, written from the service declarations.

Each service's `Compose` (shared/declaration.py) says how its container runs: its uid, its flags,
the settings it reads from the environment, what it shares and mounts. The file is checked in,
and tests/compose/test_compose_file.py fails when it differs from what this writes. What this
module holds of its own is what no service declares: the bus (`nats`), the container that holds
the namespaces some services share, the settings every container takes (image, bus, credentials)
and the file's opening comment.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from belayer_rl.shared.config import ConfigError
from belayer_rl.shared.declaration import Service, Variable
from belayer_rl.shared.roles import NATS_UID, secret_files

ENGINES = ("e0", "e1")  # the engines of the checked-in file
METRICS_PORT = "9100"  # every service serves Prometheus text on :9100/metrics, and /healthz
SHARED_NAMESPACES = "namespaces"  # the container that holds them

COMMON = {
    "BELAYER_CREDS_DIR": Variable("./creds", "what `belayer creds` wrote: auth.conf and <role>.creds"),
    "BELAYER_CLUSTER_ID": Variable("default", "must be the --cluster-id the credentials were made for"),
    "BELAYER_NATS_PORT": Variable("4222", "published on 127.0.0.1 only (monitoring stays inside `nats`)"),
    "BELAYER_IMAGE": Variable("belayer:local", "the image every service runs (scripts/build-images)"),
    "BELAYER_NATS_IMAGE": Variable("belayer-nats:local", "the bus's image"),
}

OPENING = """\
Belayer on one Docker host, written by `belayer compose-file` from the service declarations
(services/*/declaration.py): change those, not this file, then
  belayer compose-file > compose.yaml                 # --engines e0,e1,e2 for a third engine
Each service runs in its own container from one image; the bus is `nats`.

  scripts/build-images                                          # the images, built on this host
  sudo belayer creds --out creds --cluster-id default --engines e0,e1 --compose-owners
  docker-compose up -d --wait                                   # or `docker compose`
  belayer --nats nats://127.0.0.1:4222 --nats-creds creds/cli.creds generate "Once upon a time"

Each service runs as a uid of its own (its declaration's `uid`), which owns only its own secrets
(mode 0600; `belayer creds --compose-owners` gives them out from the same declarations): the
servers and engines share a pid namespace, and a uid cannot open another's /proc/<pid>/root. No
service but a root one holds a capability. The README's "Docker Compose" section says what this
isolates on one host and what it cannot, and why engines are containers of their own rather than
scaled.

Settings, from the environment or an .env file beside this one (defaults in brackets):"""


@dataclass(frozen=True)
class Container:
    name: str
    service: Service
    uid: int
    engine: str = ""  # the engine it serves, for a per-engine service
    note: str = ""


def containers(services: Sequence[Service], engines: Sequence[str]) -> list[Container]:
    """The containers of every declared service, in the declarations' order."""
    out: list[Container] = []
    for service in services:
        c = service.compose
        if c is None:
            continue
        if c.per_engine:
            out += [
                Container(f"{c.per_engine}-{e}", service, c.uid + i, e, c.note if i == 0 else "")
                for i, e in enumerate(engines)
            ]
            continue
        out.append(Container(service.name, service, c.uid, note=c.note))
        if c.standby:
            out.append(Container(c.standby, service, c.uid, note=c.standby_note))
    return out


def variables(services: Sequence[Service]) -> dict[str, Variable]:
    found = dict(COMMON)
    for service in services:
        for name, variable in (service.compose.variables if service.compose else {}).items():
            if found.setdefault(name, variable) != variable:
                raise ValueError(f"{service.name} declares ${name} again, otherwise")
    return found


def expand(value: Any, known: Mapping[str, Variable], engine: str) -> Any:
    """`value` with each `$NAME` a Compose interpolation with its default, `{engine}` filled."""
    if isinstance(value, str):

        def interpolate(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in known:
                raise ValueError(f"${name} is no declared setting")
            return f"${{{name}:-{known[name].default}}}"

        return re.sub(r"\$([A-Z][A-Z0-9_]*)", interpolate, value.replace("{engine}", engine))
    if isinstance(value, Mapping):
        return {k: expand(v, known, engine) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [expand(v, known, engine) for v in value]
    return value


def secret_name(file: str) -> str:
    """A credentials folder's file, as compose.yaml's `secrets` names it."""
    return file.removesuffix(".creds").replace(".", "-")


def block(
    container: Container, by_name: Mapping[str, list[Container]], known: Mapping[str, Variable]
) -> dict[str, Any]:
    """One container's Compose entry."""
    service, engine = container.service, container.engine
    c = service.compose
    assert c is not None
    own, others = secret_files(service, engine)
    entry: dict[str, Any] = {
        "image": "$BELAYER_IMAGE",
        "pull_policy": "never",
        "restart": "unless-stopped",
        "user": f"{container.uid}:{container.uid}",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
    }
    groups = sorted({str(o.uid) for name in c.groups for o in by_name[name]}, key=int)
    if groups:
        entry["group_add"] = groups
    if service.runs != "driver":
        entry["command"] = [
            "python", "-m", service.module, "--metrics-port", METRICS_PORT, "--metrics-host", "0.0.0.0", *c.args,
        ]  # fmt: skip
    if c.shares_namespaces:
        entry["ipc"] = entry["pid"] = f"service:{SHARED_NAMESPACES}"
    entry["environment"] = {
        "BELAYER_NATS_URL": "nats://nats:4222",
        "BELAYER_CLUSTER_ID": "$BELAYER_CLUSTER_ID",
        "BELAYER_NATS_CREDS": f"/run/secrets/{service.role_name}.creds",
        **c.environment,
    }
    entry["secrets"] = [{"source": secret_name(own), "target": f"{service.role_name}.creds"}] + [
        {"source": secret_name(file), "target": target} for file, target in others.items()
    ]
    entry["healthcheck"] = {
        "test": ["CMD", "python", "-c", "import urllib.request; urllib.request.urlopen("
                 f"'http://127.0.0.1:{METRICS_PORT}/healthz', timeout=2)"],
        "interval": "3s",
        "timeout": "10s",  # a busy host may take seconds to start a Python
        "retries": 5,
        "start_period": "120s",
    }  # fmt: skip
    if c.stop_grace:
        entry["stop_grace_period"] = c.stop_grace
    entry["depends_on"] = {"nats": {"condition": "service_healthy"}} | {
        other.name: {"condition": "service_healthy"} for name in c.after for other in by_name[name]
    }
    entry |= c.keys
    return expand(entry, known, engine)


def comment(text: str, indent: str) -> str:
    return "".join(f"{indent}# {line}".rstrip() + "\n" for line in text.splitlines())


def paragraph(text: str, bullet: str = "") -> str:
    """`text` joined and filled to the file's width, after `bullet`."""
    return textwrap.fill(
        " ".join(text.split()), 96, initial_indent=bullet, subsequent_indent=" " * len(bullet)
    )


def render(services: Sequence[Service], engines: Sequence[str] = ENGINES) -> str:
    """compose.yaml for `engines`, from the declarations."""
    known = variables(services)
    all_containers = containers(services, engines)
    by_name: dict[str, list[Container]] = {}
    for container in all_containers:
        by_name.setdefault(container.service.name, []).append(container)
    sharing = [(c, c.service.compose.shares_namespaces) for c in all_containers if c.service.compose]
    sharing = [(c, why) for c, why in sharing if why]

    settings = "\n".join(
        textwrap.fill(f"{name} [{v.default}]: {v.help}", 96, initial_indent="  ", subsequent_indent="      ")
        for name, v in known.items()
    )
    out = comment(f"{OPENING}\n{settings}", "") + "\nname: belayer\n\nservices:\n"
    nats = {
        "image": "$BELAYER_NATS_IMAGE",
        "pull_policy": "never",
        "restart": "unless-stopped",
        "user": f"{NATS_UID}:{NATS_UID}",  # it reads auth.conf, a mode-0600 secret of this uid
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "configs": [{"source": "nats-conf", "target": "/etc/nats/nats.conf"}],
        # nats.conf includes auth.conf from its own folder
        "secrets": [{"source": "nats-auth", "target": "/etc/nats/auth.conf"}],
        "volumes": ["jetstream:/data"],
        "ports": ["127.0.0.1:$BELAYER_NATS_PORT:4222"],
        "healthcheck": {
            "test": ["CMD", "/bin/busybox", "wget", "-q", "-O", "/dev/null",
                     "http://127.0.0.1:8222/healthz?js-enabled-only=true"],
            "interval": "2s", "timeout": "2s", "retries": 10, "start_period": "10s",
        },
    }  # fmt: skip
    out += comment("The bus: NATS with JetStream, each role's permissions in auth.conf.", "  ")
    out += dump({"nats": expand(nats, known, "")})
    if sharing:
        why = [
            paragraph(reason, f"- {c.name.removesuffix(c.engine)}{c.engine and '*'}: ")
            for c, reason in sharing
            if c.engine in ("", engines[0])
        ]
        opening = paragraph(
            f"Holds the IPC and pid namespaces that {', '.join(c.name for c, _ in sharing)} share, so that"
            " restarting any one of them leaves the others' namespaces, and /dev/shm, in place. Its init"
            " (docker-init) is pid 1 of that namespace and reaps orphans. Restarting this one ends every"
            " process in the namespace; the restart policies bring them back. Recreating it (a new"
            " image) leaves them dead until they are recreated too: `up` does so, and so does `run`"
            " of the trainer, which depends on every engine for that. Why each shares them:"
        )
        out += "\n" + comment("\n".join([opening, *why]), "  ")
        holder = {
            "image": "$BELAYER_IMAGE",
            "pull_policy": "never",
            "restart": "unless-stopped",
            "user": "65534:65534",  # nobody: it holds no secret
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges:true"],
            "init": True,
            "command": ["sleep", "infinity"],
            "network_mode": "none",
            "ipc": "shareable",
            "shm_size": "$BELAYER_SHM_SIZE" if "BELAYER_SHM_SIZE" in known else "64m",
        }
        out += dump({SHARED_NAMESPACES: expand(holder, known, "")})
    for container in all_containers:
        out += "\n" + comment(container.note, "  ") + dump({container.name: block(container, by_name, known)})

    files = {"nats-auth": "auth.conf"}
    for container in all_containers:
        own, others = secret_files(container.service, container.engine)
        files |= {secret_name(f): f for f in (own, *others)}
    volumes = ["jetstream"] + [
        v["source"] if isinstance(v, Mapping) else v.split(":")[0]
        for c in all_containers
        for v in (c.service.compose.keys.get("volumes", []) if c.service.compose else [])
        if isinstance(v, str) or v["type"] == "volume"
    ]
    tail = {
        "configs": {"nats-conf": {"file": "./docker/nats.conf"}},
        "secrets": {name: {"file": f"$BELAYER_CREDS_DIR/{file}"} for name, file in files.items()},
        "volumes": {name: None for name in dict.fromkeys(volumes)},
    }
    return out + "\n" + dump(expand(tail, known, ""), indent="")


def dump(value: Mapping[str, Any], indent: str = "  ") -> str:
    """YAML as a person writes compose.yaml: mappings as blocks, lists of plain values on one line."""
    import yaml  # only this command needs it

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(
        dict, lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=False)
    )
    Dumper.add_representer(
        list,
        lambda dumper, data: dumper.represent_sequence(
            "tag:yaml.org,2002:seq", data, flow_style=all(not isinstance(v, dict | list) for v in data)
        ),
    )
    text = yaml.dump(dict(value), Dumper=Dumper, sort_keys=False, width=110)
    text = text.replace(": null\n", ":\n")  # a named volume with Compose's defaults
    return "".join(f"{indent}{line}\n" for line in text.splitlines())


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("compose-file", help="write compose.yaml from the service declarations")
    parser.add_argument("--engines", default=",".join(ENGINES), help="the engines' ids, comma-separated")
    parser.add_argument("--check", type=Path, help="exit 1 when this file differs from what would be written")
    parser.set_defaults(run=cmd_compose_file)


def cmd_compose_file(args: argparse.Namespace) -> int:
    from belayer_rl.services import SERVICES

    engines = tuple(e for e in args.engines.split(",") if e)
    if not engines:
        raise ConfigError("--engines names no engine")
    text = render(SERVICES, engines)
    if args.check is not None:
        if args.check.read_text() != text:
            print(f"{args.check} differs from what `belayer compose-file` writes", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0
