"""compose.yaml is written by `belayer compose-file` from the service declarations, and checked in:
the file in the repository is what the command writes (the Compose tests then run that file for
real), and a declaration that changes makes the check fail until the file is written again."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

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


def run_tree(services: dict[str, Any], name: str) -> set[str]:
    """`name` and everything it depends on: what `compose run NAME` starts, and recreates when its
    image changed."""
    tree: set[str] = set()
    todo = [name]
    while todo:
        if (current := todo.pop()) not in tree:
            tree.add(current)
            todo.extend(services[current].get("depends_on", {}))
    return tree


def test_running_the_trainer_after_a_rebuild_recreates_every_container_of_the_shared_namespaces() -> None:
    """`run trainer` after a new image recreates what the trainer depends on, the namespaces'
    holder among them; a container that shares its pid namespace and is not in that tree is killed
    with the old holder and stays dead (its restart policy cannot rejoin a removed container), as
    two engines once did. Mutation: the trainer's dependencies without the engines leave them out."""
    for engines in (("e0", "e1"), ("e0", "e1", "e2")):
        services = yaml.safe_load(render(SERVICES, engines))["services"]
        sharing = {name for name, s in services.items() if s.get("pid") == "service:namespaces"}
        assert {f"engine-{e}" for e in engines} <= sharing
        assert sharing <= run_tree(services, "trainer"), sharing - run_tree(services, "trainer")

    trainer = next(s for s in SERVICES if s.name == "trainer")
    assert trainer.compose is not None
    without = dataclasses.replace(trainer.compose, after=("router", "weight-server"))
    changed = tuple(dataclasses.replace(s, compose=without) if s is trainer else s for s in SERVICES)
    services = yaml.safe_load(render(changed))["services"]
    assert "engine-e0" not in run_tree(services, "trainer")
