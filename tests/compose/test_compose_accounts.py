"""compose.yaml's accounts against the declarations' Compose uids, without Docker.

`belayer creds --compose-owners` gives each secret to a uid from the declarations; compose.yaml runs each
service as a uid of its own. The two must agree, or a service could not read its own secret (or
could read another's). Also: no two services that hold different secrets share a uid, only the
checkpointer holds capabilities, and the KV server and engines hold the groups their shared
memory needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from belayer_rl.services import SERVICES
from belayer_rl.services.checkpointer.declaration import CHECKPOINTER
from belayer_rl.services.shadow_supervisor.declaration import SHADOW_SUPERVISOR
from belayer_rl.services.weight_server.declaration import WEIGHT_SERVER
from belayer_rl.shared.declaration import Service
from belayer_rl.shared.roles import Credentials, compose_owners
from belayer_rl.shared.subjects import Subjects

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "compose.yaml"


def services() -> dict[str, dict]:  # type: ignore[type-arg]
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


def engines() -> tuple[str, ...]:
    return tuple(name.removeprefix("engine-") for name in services() if name.startswith("engine-"))


def compose_uid(service: Service) -> int:
    assert service.compose is not None
    return service.compose.uid


def uid_of(service: dict) -> int:  # type: ignore[type-arg]
    uid, gid = service["user"].split(":")
    assert uid == gid, service["user"]  # each uid is its own group
    return int(uid)


def test_each_service_runs_as_the_owner_of_each_secret_it_reads(tmp_path: Path) -> None:
    spec = yaml.safe_load(COMPOSE_FILE.read_text())
    files = {name: Path(entry["file"]).name for name, entry in spec["secrets"].items()}
    Credentials.generate(SERVICES, Subjects("default"), engines()).write(tmp_path)
    owners = {path.name: uid for path, uid in compose_owners(SERVICES, tmp_path, engines()).items()}
    holders: dict[int, set[str]] = {}
    for name, service in services().items():
        uid = uid_of(service)
        for secret in service.get("secrets", []):
            assert owners[files[secret["source"]]] == uid, (name, secret["source"])
            holders.setdefault(uid, set()).add(files[secret["source"]])
    assert owners["auth.conf"] == uid_of(services()["nats"])
    # The router and its standby share a uid and a secret; no other two services share a uid.
    uids = [uid_of(s) for name, s in services().items() if name != "router-standby"]
    assert len(uids) == len(set(uids)), uids
    assert holders[uid_of(services()["engine-e0"])] == {"engine-e0.creds", "shadow-supervisor-e0.creds"}


def test_only_the_checkpointer_keeps_capabilities_and_shared_memory_has_its_groups() -> None:
    for name, service in services().items():
        if name == "checkpointer":
            assert service["cap_drop"] == [] and uid_of(service) == compose_uid(CHECKPOINTER) == 0
        else:
            assert service["cap_drop"] == ["ALL"], name
            assert "no-new-privileges:true" in service["security_opt"], name
            assert uid_of(service) != 0, name
    weights = str(compose_uid(WEIGHT_SERVER))
    engine_uids = {str(uid_of(services()[f"engine-{e}"])) for e in engines()}
    assert engine_uids == {str(compose_uid(SHADOW_SUPERVISOR) + i) for i in range(len(engines()))}
    assert set(services()["kv-server"]["group_add"]) == engine_uids
    for engine in engines():
        assert services()[f"engine-{engine}"]["group_add"] == [weights], engine


def test_compose_owners_gives_each_secret_to_its_service_and_the_rest_to_the_sudo_user(
    tmp_path: Path,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to other uids needs root (CI runs as root)")
    out = tmp_path / "creds"
    env = {**os.environ, "SUDO_UID": "1234", "SUDO_GID": "1235"}
    belayer = "import sys; from belayer_rl.cli.main import main; main(sys.argv[1:])"
    argv = [sys.executable, "-c", belayer, "creds", "--out", str(out), "--compose-owners"]
    subprocess.run(argv, env=env, check=True, capture_output=True)
    owners = {path.name: (path.stat().st_uid, path.stat().st_gid) for path in out.iterdir()}
    assert owners["router.creds"] == (2001, 2001) and owners["auth.conf"] == (2000, 2000)
    assert owners["engine-e1.creds"] == owners["shadow-supervisor-e1.creds"] == (2101, 2101)
    assert owners["checkpoint.key"] == (0, 0)
    assert owners["cli.creds"] == owners["admin.creds"] == (1234, 1235)
    assert (out.stat().st_uid, out.stat().st_mode & 0o777) == (1234, 0o700)
    assert {path.stat().st_mode & 0o777 for path in out.iterdir()} == {0o600}
