"""The declarations (shared/declaration.py) are the one place a service's surface is written: its
role's permissions, its runtime endpoints, its process in `belayer up`, its compose.yaml container
and `belayer status` are made from them.

Read from the generated permissions, as nats-server would apply them: every subject a service
subscribes to or publishes is allowed to its role, and a subject it answers requests on is
allowed to no other service's role. A throwaway declaration shows up everywhere with no other edit.
No server runs here: the permissions are checked as nats-server matches subjects (token by token,
`*` one token, `>` the rest); tests/auth/test_permissions.py checks the same tables against a real
nats-server.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml

from belayer_rl.cli.cluster import ClusterConfig, Supervisor, UpSettings
from belayer_rl.cli.compose_file import render
from belayer_rl.services import SERVICES
from belayer_rl.services.shadow_supervisor.supervisor import EngineSlot, ShadowSupervisor
from belayer_rl.services.worker.declaration import WORKER
from belayer_rl.shared import protocol
from belayer_rl.shared.config import (
    ConfigError,
    PolicyConfig,
    RouterConfig,
    ShadowSupervisorConfig,
    WorkerConfig,
    add_flags,
    from_args,
)
from belayer_rl.shared.declaration import (
    Compose,
    Kind,
    Listen,
    Planned,
    Scope,
    Service,
    Variable,
    event,
    stats_keys,
    up_settings,
)
from belayer_rl.shared.roles import Credentials, compose_owners
from belayer_rl.shared.subjects import Subjects

NAMES = Subjects("c1")
ENGINES = ("e0", "e1")


def covers(pattern: str, subject: str) -> bool:
    """Whether the permission `pattern` allows `subject`, itself perhaps a wildcard subscription:
    a wildcard subject is allowed only by a pattern at least as wide at each token."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or have[i] == ">":
            return False
        if token != "*" and token != have[i]:
            return False
    return len(want) == len(have)


def allowed(entry: dict[str, object], kind: str, subject: str) -> bool:
    permissions = entry.get("permissions")
    if permissions is None:  # the operator's credential: everything
        return True
    assert isinstance(permissions, dict)
    return any(covers(pattern, subject) for pattern in permissions[kind]["allow"])


def permissions(services: tuple[Service, ...]) -> dict[str, dict[str, object]]:
    creds = Credentials.generate(services, NAMES, ENGINES, clients=("alice",))
    return {user.name: entry for user, entry in zip(creds.users, creds.users_entries(), strict=True)}


def user_of(service: Service) -> tuple[str, Scope]:
    """The user a process of `service` runs as, and the scope it serves there (engine e0)."""
    per_engine = service.runs == "engine"
    user = f"{service.role_name}-e0" if per_engine else service.role_name
    return user, Scope(engine="e0", host="h1", client=user, run="r1", group="actor", rank="0", pid="7")


def uncovered(services: tuple[Service, ...], table: dict[str, dict[str, object]]) -> list[str]:
    """What some declared service does that its role's permissions do not allow."""
    missing = []
    for service in services:
        user, scope = user_of(service)
        entry = table[user]
        listened = [listen.subject for listen in service.listens.values()] + list(service.subscribes)
        missing += [
            f"{user} sub {s(NAMES, scope)}"
            for s in listened
            if not allowed(entry, "subscribe", s(NAMES, scope))
        ]
        missing += [
            f"{user} pub {s(NAMES, scope)}"
            for s in service.publishes
            if not allowed(entry, "publish", s(NAMES, scope))
        ]
        for store in (*service.owns, *service.reads):
            info = f"$JS.API.STREAM.INFO.{store(NAMES)}"
            if not allowed(entry, "publish", info):
                missing.append(f"{user} info {store(NAMES)}")
        if service.runs != "driver" and not allowed(
            entry, "subscribe", NAMES.service_stats(service.stats_key(scope))
        ):
            missing.append(f"{user} stats {service.stats_key(scope)}")
    return missing


def test_every_subject_a_service_uses_is_allowed_to_its_role() -> None:
    assert uncovered(SERVICES, permissions(SERVICES)) == []


def test_the_check_catches_a_declaration_that_lost_a_subject() -> None:
    """Mutation: the router's role made from a declaration without its lease writes (and the
    checkpointer's without its endpoints) is caught against the real declarations."""
    router, checkpointer = (
        next(s for s in SERVICES if s.name == name) for name in ("router", "checkpointer")
    )
    narrowed = tuple(
        dataclasses.replace(s, publishes=s.publishes[:-1])
        if s is router
        else dataclasses.replace(s, listens={})
        if s is checkpointer
        else s
        for s in SERVICES
    )
    missing = uncovered(SERVICES, permissions(narrowed))
    assert any(m.startswith("router pub $KV.belayer_router_c1") for m in missing), missing
    assert any(m.startswith("checkpointer sub belayer.c1.sandbox.h1") for m in missing), missing


def test_a_subject_a_service_answers_on_is_no_other_services_to_read() -> None:
    """Requests reach only their server: no other service role (nor another engine's credential)
    may subscribe where one answers. The operator's admin credential may do anything."""
    table = permissions(SERVICES)
    readers = []
    for service in SERVICES:
        user, scope = user_of(service)
        for listen in service.listens.values():
            if listen.reply is None:
                continue  # an event: anyone allowed may listen
            subject = listen.subject(NAMES, scope)
            readers += [
                f"{other} may read {subject}"
                for other, entry in table.items()
                if other not in (user, "admin")
                and allowed(entry, "subscribe", subject)
                # the every-engine supervisor of `belayer up` runs e0 as well
                and not (other == service.role_name and service.all_engines)
            ]
    assert readers == []
    # The control: the check sees a reader where there is one.
    assert allowed(table["engine-e0"], "subscribe", NAMES.worker_dispatch("e0"))
    assert not allowed(table["engine-e1"], "subscribe", NAMES.worker_dispatch("e0"))


PROBE = Service(
    name="probe",
    summary="A throwaway service: nothing but its declaration.",
    runs="cluster",
    listens={"ask": Listen(lambda s, x: f"{s.root}.probe.ask", protocol.StatsRequest, protocol.Ack)},
    publishes=(event("record_skipped"),),
    owns=(lambda s: f"PROBE_{s.cluster_id}",),
    config=PolicyConfig,
    setup="tests.probe.service:setup",  # never started here: compose.yaml names its module
    up=lambda cluster: [Planned("probe", PolicyConfig(**cluster.settings(PolicyConfig, "probe")))],
    up_settings=("cooldown_s",),
    up_flags={"cooldown_s": "--probe-cooldown"},
    compose=Compose(
        uid=2999, args=("--depth", "$PROBE_DEPTH"), variables={"PROBE_DEPTH": Variable("3", "how deep")}
    ),
)


def test_a_new_declaration_gets_its_role_endpoints_status_row_and_container_with_no_other_edit(
    tmp_path: Path,
) -> None:
    services = (*SERVICES, PROBE)
    table = permissions(services)
    assert "probe" in table and "probe" not in permissions(SERVICES)
    assert uncovered(services, table) == []
    assert allowed(table["probe"], "subscribe", "belayer.c1.probe.ask")
    assert allowed(table["probe"], "publish", "$JS.API.STREAM.UPDATE.PROBE_c1")
    assert not allowed(table["probe"], "publish", "belayer.c1.probe.ask")  # it serves, it does not call
    assert "probe" in stats_keys(services, {"e0": [7]}, hosts=["h1"])

    compose = yaml.safe_load(render(services))
    assert "probe" not in yaml.safe_load(render(SERVICES))["services"]
    probe = compose["services"]["probe"]
    assert probe["user"] == "2999:2999" and probe["command"][:3] == ["python", "-m", "tests.probe"]
    assert probe["command"][-2:] == ["--depth", "${PROBE_DEPTH:-3}"]
    assert probe["secrets"] == [{"source": "probe", "target": "probe.creds"}]
    assert probe["environment"]["BELAYER_NATS_CREDS"] == "/run/secrets/probe.creds"
    assert compose["secrets"]["probe"] == {"file": "${BELAYER_CREDS_DIR:-./creds}/probe.creds"}
    (tmp_path / "probe.creds").write_text("")
    assert compose_owners(services, tmp_path, ("e0",)) == {tmp_path / "probe.creds": 2999}

    # `belayer up`'s flags: its up_settings, under its own flag, handed on to its process
    settings = up_settings(services)
    parser = argparse.ArgumentParser()
    add_flags(parser, settings)
    passed = from_args(settings, parser.parse_args(["--probe-cooldown", "7"]))
    assert passed.cooldown_s == 7.0 and not hasattr(UpSettings(), "cooldown_s")
    with pytest.raises(TypeError, match="both pass on 'chunk_tokens'"):
        up_settings(
            (
                *SERVICES,
                dataclasses.replace(PROBE, config=RouterConfig, up_settings=("chunk_tokens",), up_flags={}),
            )
        )

    # `belayer up`'s plan: its process, started from its module with its own credential
    config = ClusterConfig(state_dir=tmp_path / "cluster", sandboxes=False, services=passed)
    supervisor = Supervisor(config, "nats://127.0.0.1:4222", None, tmp_path)  # type: ignore[arg-type]  # plan() uses no bus
    planned = {child.name: child.argv for child in supervisor.plan(services)}
    assert "probe" not in {child.name for child in supervisor.plan()}
    assert planned["probe"][1:3] == ["-m", "tests.probe"]
    assert planned["probe"][planned["probe"].index("--nats-creds") + 1] == str(tmp_path / "probe.creds")
    assert planned["probe"][planned["probe"].index("--cooldown") + 1] == "7.0"

    async def answer(_: protocol.StatsRequest) -> protocol.Ack:
        return protocol.Ack()

    (endpoint,) = PROBE.endpoints(NAMES, None, ask=answer)
    assert (endpoint.subject, endpoint.accepts, endpoint.reply) == (
        "belayer.c1.probe.ask",
        protocol.StatsRequest,
        True,
    )
    with pytest.raises(TypeError, match="no endpoint tell"):
        PROBE.endpoints(NAMES, None, tell=answer)


def test_status_asks_every_kind_of_process_under_the_key_it_answers_on() -> None:
    keys = stats_keys(SERVICES, {"e0": [11, 12], "e1": [13]}, hosts=["h1"])
    assert {"router", "weight-server", "kv-server", "shadow-supervisor", "policy", "checkpointer.h1"} <= set(
        keys
    )
    assert {"worker.e0.11", "worker.e0.12", "worker.e1.13"} <= set(keys)
    assert not any(key.startswith("trainer") for key in keys)  # a training run's groups: the trainer's own


def test_every_declared_process_starts_from_its_module_with_its_name_and_flags() -> None:
    """`python -m belayer_rl.services.<folder>` is the generic entry point (shared/declaration.py
    main) for every declared kind of process: its prog, its summary and its config's flags."""
    import subprocess
    import sys

    folders = {
        service.name: service.setup.split(":")[0].split(".")[2] for service in SERVICES if service.setup
    }
    assert set(folders) == {s.name for s in SERVICES if s.runs != "driver"}
    for service in SERVICES:
        if not service.setup:
            continue
        done = subprocess.run(
            [sys.executable, "-m", f"belayer_rl.services.{folders[service.name]}", "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: belayer-{service.name} "), done.stdout[:200]
        assert service.summary in " ".join(done.stdout.split()), service.name
        assert "--nats-url" in done.stdout or "--nats" in done.stdout


def test_a_new_engine_is_a_kind_of_the_worker_with_no_other_edit(tmp_path: Path) -> None:
    """A second program behind the worker's declaration: `belayer up --engine <kind>` reaches the
    bare workers and the shadow supervisor (which passes it to the workers it starts), through the
    same entry point; the real declarations do not know the kind, and a worker of an unknown kind
    does not start."""
    probe = Kind("probe", "tests.probe.engine:setup", "a throwaway engine")
    worker = dataclasses.replace(WORKER, kinds=(*WORKER.kinds, probe))
    services = tuple(worker if s is WORKER else s for s in SERVICES)
    settings = up_settings(services)
    parser = argparse.ArgumentParser()
    add_flags(parser, settings)
    passed = from_args(settings, parser.parse_args(["--engine", "probe"]))
    assert passed.kind == "probe" and UpSettings().kind == "builtin"
    real = argparse.ArgumentParser()
    add_flags(real, UpSettings)
    with pytest.raises(SystemExit):  # argparse: invalid choice 'probe'
        real.parse_args(["--engine", "probe"])

    for shadows, process in ((False, "worker-e0"), (True, "shadow-supervisor")):
        config = ClusterConfig(
            state_dir=tmp_path / "cluster", sandboxes=False, shadows=shadows, services=passed
        )
        supervisor = Supervisor(config, "nats://127.0.0.1:4222", None, None)  # type: ignore[arg-type]  # plan() uses no bus
        argv = {child.name: child.argv for child in supervisor.plan(services)}[process]
        assert argv[argv.index("--kind") + 1] == "probe", argv

    shadow_config = ShadowSupervisorConfig(engines=("e0",), state_dir=tmp_path, kind="probe")
    shadows = ShadowSupervisor(shadow_config, None, None, lambda *_: None)  # type: ignore[arg-type]  # worker_argv uses no bus
    argv = shadows.worker_argv(EngineSlot("e0"), "main", tmp_path / "heartbeat", None)
    assert argv[1:3] == ["-m", "belayer_rl.services.worker"] and argv[argv.index("--kind") + 1] == "probe"

    assert worker.setup_of(WorkerConfig(engine_id="e0", kind="probe")) == probe.setup
    assert WORKER.setup_of(WorkerConfig(engine_id="e0")) == WORKER.setup
    with pytest.raises(ConfigError, match=r"worker comes in builtin, vllm$"):
        WORKER.setup_of(WorkerConfig(engine_id="e0", kind="probe"))
    with pytest.raises(TypeError, match="first kind is its setup"):
        dataclasses.replace(WORKER, kinds=(probe, *WORKER.kinds))
