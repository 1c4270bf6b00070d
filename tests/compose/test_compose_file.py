"""compose.yaml is written by `belayer compose-file` from the service declarations, and checked in:
the file in the repository is what the command writes (the Compose tests then run that file for
real), and a declaration that changes makes the check fail until the file is written again."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from belayer_rl.cli.compose_file import render
from belayer_rl.services import SERVICES
from belayer_rl.services.policy.declaration import POLICY
from tests.cli.helpers import belayer

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "compose.yaml"


def test_the_checked_in_file_is_what_the_command_writes(tmp_path: Path) -> None:
    done = belayer("compose-file", "--check", str(COMPOSE_FILE))
    assert done.returncode == 0, done.stderr
    written = belayer("compose-file")
    assert written.returncode == 0 and written.stdout == COMPOSE_FILE.read_text()
    # Mutation: a declaration changed and the file not written again fails the check.
    assert POLICY.compose is not None
    moved = dataclasses.replace(POLICY, compose=dataclasses.replace(POLICY.compose, uid=2998))
    changed = tuple(moved if s is POLICY else s for s in SERVICES)
    assert render(changed) != COMPOSE_FILE.read_text()
    stale = tmp_path / "compose.yaml"
    stale.write_text(render(changed))
    refused = belayer("compose-file", "--check", str(stale))
    assert refused.returncode == 1 and "differs" in refused.stderr


def test_a_third_engine_is_a_flag_its_container_uid_and_groups_follow() -> None:
    spec = yaml.safe_load(render(SERVICES, ("e0", "e1", "e2")))
    services = spec["services"]
    engine = services["engine-e2"]
    assert (
        engine["user"] == "2102:2102" and engine["command"][engine["command"].index("--engines") + 1] == "e2"
    )
    assert {s["source"] for s in engine["secrets"]} == {"shadow-supervisor-e2", "engine-e2"}
    assert services["kv-server"]["group_add"] == ["2100", "2101", "2102"]  # each engine's arena group
    assert {"shadow-supervisor-e2", "engine-e2"} <= set(spec["secrets"])
