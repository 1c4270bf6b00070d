"""Configs are the one source of a service's flags: a config rendered as argv (what `belayer up`
and the shadow supervisor pass on) parses back to the same config, a bad value names its flag, and
an event endpoint must expect the type its kind declares."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from belayer_rl.cli.cluster import ClusterConfig, UpSettings
from belayer_rl.shared import protocol
from belayer_rl.shared.config import (
    CheckpointerConfig,
    ConfigError,
    KvServerConfig,
    RouterConfig,
    ShadowSupervisorConfig,
    WeightServerConfig,
    WorkerConfig,
    add_flags,
    from_args,
    to_argv,
)
from belayer_rl.shared.runtime import Endpoint, check_declared
from belayer_rl.shared.subjects import Subjects

NAMES = Subjects()  # the default cluster's names

NATS = "nats://127.0.0.1:4222"
CONFIGS = [
    RouterConfig(nats_url=NATS, chunk_tokens=32, handover_grace_s=1.5, client_timeout_s=7.0),
    WorkerConfig(
        nats_url=NATS,
        engine_id="e3",
        role="shadow",
        shared_memory=True,
        watch_pid=42,
        watch_file=Path("/tmp/hb"),
        heartbeat_file=Path("/tmp/own"),
        hang_timeout_s=0.5,
    ),
    ShadowSupervisorConfig(nats_url=NATS, engines=("e0", "e1"), state_dir=Path("/tmp/w"), num_blocks=64),
    WeightServerConfig(nats_url=NATS, preset="small", shm_prefix="blx", device="cpu", free_grace_s=0.0),
    KvServerConfig(nats_url=NATS, shm_prefix="blx", device="cpu", max_arena_mb=64),
    CheckpointerConfig(nats_url=NATS, host_id="h1", state_dir=Path("/tmp/ck"), object_store=True),
    ClusterConfig(
        state_dir=Path("/tmp/c"),
        engines=3,
        shadows=False,
        sandboxes=False,
        services=UpSettings(preset="small"),
    ),
]


def parse(cls: type, argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    return from_args(cls, parser.parse_args(argv))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: type(c).__name__)
def test_a_config_rendered_as_argv_parses_back_to_itself(config) -> None:
    argv = to_argv(config)
    again = parse(type(config), argv)
    # Mutation check: the same argv with one value changed parses to a different config.
    changed = parse(type(config), [*argv, "--nats", "nats://elsewhere:1"])

    assert again == config, argv
    assert changed != config


def test_a_default_is_written_once() -> None:
    """What the cluster passes on repeats the service's default, not a copy of its own."""
    assert ClusterConfig(state_dir=Path("/x")).services.chunk_tokens == RouterConfig().chunk_tokens
    assert (
        ShadowSupervisorConfig(engines=("e0",), state_dir=Path("/x")).hang_timeout_s
        == WorkerConfig(engine_id="e0").hang_timeout_s
    )
    assert to_argv(RouterConfig(nats_url=NATS)) == ["--nats", NATS]  # defaults are not repeated


@pytest.mark.parametrize(
    ("variable", "argv", "allowed"),
    [("", [], False), ("true", [], True), ("0", [], False), ("no", ["--allow-root-user"], True)],
)
def test_a_yes_or_no_setting_reads_its_variable_when_its_flag_is_absent(
    monkeypatch, variable: str, argv: list[str], allowed: bool
) -> None:
    monkeypatch.setenv("BELAYER_ALLOW_ROOT_USER", variable)
    config = parse(CheckpointerConfig, ["--nats", NATS, "--host-id", "h1", *argv])
    assert isinstance(config, CheckpointerConfig) and config.allow_root_user is allowed


def test_a_yes_or_no_variable_that_says_neither_is_an_error(monkeypatch) -> None:
    monkeypatch.setenv("BELAYER_ALLOW_ROOT_USER", "maybe")
    with pytest.raises(ConfigError, match="BELAYER_ALLOW_ROOT_USER"):
        parse(CheckpointerConfig, ["--nats", NATS, "--host-id", "h1"])


@pytest.mark.parametrize(
    ("cls", "argv", "flag"),
    [
        (RouterConfig, ["--nats", NATS, "--chunk-tokens", "0"], "--chunk-tokens"),
        (WorkerConfig, ["--nats", NATS, "--engine-id", "e0", "--role", "shadow"], "--role shadow"),
        (KvServerConfig, ["--nats", NATS, "--max-arena-mb", "-1"], "--max-arena-mb"),
        (CheckpointerConfig, ["--nats", NATS, "--host-id", "bad host"], "--host-id"),
    ],
)
def test_a_bad_value_names_its_flag(cls, argv, flag) -> None:
    with pytest.raises(ConfigError) as raised:
        parse(cls, argv)
    message = str(raised.value)

    assert message.startswith(flag), message


def test_an_event_endpoint_must_expect_the_type_its_kind_declares() -> None:
    subject = NAMES.event("heartbeat", "*")
    check_declared(Endpoint(subject, protocol.Heartbeat, handler=lambda m: None))  # type: ignore[arg-type]
    with pytest.raises(TypeError) as raised:
        check_declared(Endpoint(subject, protocol.WorkerFailed, handler=lambda m: None))  # type: ignore[arg-type]
    message = str(raised.value)

    assert "Heartbeat" in message
