"""What a service is, said once: the declaration each service keeps beside its code.

A declaration names the service, its config, how many of it run (once per cluster, per host, per
engine), what it listens to (each endpoint's subject, request type and reply type), what it
publishes and which streams, buckets and object stores it owns or reads. Everything else that
used to repeat those facts is derived from it:

- the runtime's subscriptions and decoders (`Service.endpoints`: setup binds handlers by name);
- the NATS permissions of the service's role (shared/roles.py);
- the process's entry point (`main`: `python -m belayer_rl.services.<name>`);
- the services `belayer status` asks for their stats;
- `belayer up`'s plan and flags (`Service.up`, `up_settings`), and compose.yaml (`Compose`).

Subjects are written as functions of the cluster's names (shared/subjects.py, the contract) and
of a `Scope`: the engine, host, client or group a process serves. The runtime fills the scope
from the config; the permissions fill it with placeholders (`{engine}`, `{client}`) or wildcards.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from belayer_rl.shared import runtime
from belayer_rl.shared.config import ConfigError, ServiceConfig, parse_flags, same_as
from belayer_rl.shared.protocol import EVENT_TYPES, Message
from belayer_rl.shared.runtime import Endpoint
from belayer_rl.shared.subjects import Subjects

Runs = Literal["cluster", "host", "engine", "group", "driver"]
ANY = "*"


@dataclass(frozen=True)
class Scope:
    """What one process's subjects are filled with. A field it does not serve stays a wildcard."""

    engine: str = ANY
    host: str = ANY
    client: str = ANY
    run: str = ANY
    group: str = ANY
    rank: str = ANY
    pid: str = ANY  # for a kind whose processes run side by side (an engine's main and shadow)


# The scope a role's permissions are written with: `{engine}` and `{client}` are filled per user
# (shared/roles.py), the rest may be any.
PERMISSION_SCOPE = Scope(engine="{engine}", client="{client}")

Subject = Callable[[Subjects, Scope], str]
Store = Callable[[Subjects], str]  # a stream's JetStream name


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def kv_put(bucket: str, key: str = ">") -> str:
    """The subject a put (or delete) of `key` in a key-value bucket goes out on."""
    return f"$KV.{bucket}.{key}"


def object_put(bucket: str) -> str:
    """The subjects an object store's chunks and metadata go out on."""
    return f"$O.{bucket}.>"


STREAM_NAMES = "$JS.API.STREAM.NAMES"  # nats-py looks an object store's stream up by subject


@dataclass(frozen=True)
class Listen:
    """One endpoint: messages of type `accepts` on `subject`; `reply` is the type answered (None
    for a one-way subject). As runtime.Endpoint, whose other switches it carries."""

    subject: Subject
    accepts: Any
    reply: Any = None
    concurrent: bool = False
    with_subject: bool = False


def on_event(kind: str, ident: Callable[[Scope], str] = lambda scope: ANY) -> Listen:
    """A one-way endpoint on an event of `kind`, decoded as protocol.EVENT_TYPES declares it;
    `ident`: the id token it listens on (any, by default)."""
    return Listen(lambda s, x: s.event(kind, ident(x)), EVENT_TYPES[kind])


def event(kind: str, ident: Callable[[Scope], str] = lambda scope: ANY) -> Subject:
    """The subject of an event of `kind` it publishes: under any id, or under `ident`'s."""
    return lambda s, x: s.event(kind, ident(x))


class Deployment(Protocol):
    """The cluster `belayer up` plans (cli/cluster.py), as a declaration's `up` reads it."""

    state_dir: Path  # the cluster's state: a service keeps its own under it
    engines: tuple[str, ...]
    shadows: bool  # workers run under the shadow supervisor, beside the weight and KV servers
    engine_kind: str  # the engines' kind (WorkerConfig.kind): only "builtin" maps from those servers
    sandboxes: bool  # sandboxes wanted, and a Docker engine answered
    gateway: bool  # the HTTP gateway wanted (`belayer up --gateway`)
    standby_routers: int
    shm_prefix: str  # this cluster's shared-memory segment names start with it
    creds_dir: Path | None  # each role's credentials; None: the bus is open

    def settings(self, cls: type[ServiceConfig], role: str) -> dict[str, Any]:
        """The keywords of a `cls` of `role`: its bus, and what the cluster's flags hand on."""
        ...


@dataclass(frozen=True)
class Planned:
    """A process `belayer up` runs."""

    name: str
    config: ServiceConfig
    engine: str = ""  # the engine it is, for a bare worker: its exit fails that engine's requests
    python: Path | None = None  # the interpreter that runs it; None: the one running `belayer up`


@dataclass(frozen=True)
class Variable:
    """A setting Compose reads from the environment (or an .env file): `$NAME` in a Compose args."""

    default: str
    help: str


@dataclass(frozen=True)
class Compose:
    """How compose.yaml runs the service (`belayer compose-file` writes the file from the
    declarations): what a deployment needs that no endpoint says."""

    uid: int  # its own uid and group (0: root); the secrets it reads are given to this uid alone
    note: str = ""  # the comment above its block: why it runs as it does
    args: tuple[str, ...] = ()  # flags past the bus's and the metrics'; "$NAME" is a variable's value
    variables: Mapping[str, Variable] = field(default_factory=dict)  # the settings it introduces
    per_engine: str = ""  # a container per engine, "<per_engine>-<engine>", its uid `uid` + the index
    standby: str = ""  # the name of a second container of the same service (a warm standby)
    standby_note: str = ""
    groups: tuple[str, ...] = ()  # the services whose files it reads: it holds their groups
    # Why it joins the IPC (/dev/shm) and pid namespaces that servers and engines share; "": it does not.
    shares_namespaces: str = ""
    environment: Mapping[str, str] = field(default_factory=dict)
    # files of the credentials folder beyond its role's: file -> where it reads it ({engine} filled)
    secrets: Mapping[str, str] = field(default_factory=dict)
    after: tuple[
        str, ...
    ] = ()  # the services (every container of each) that must be healthy before it starts
    stop_grace: str = ""  # Compose's stop_grace_period, when its drain needs more than the default
    keys: Mapping[str, Any] = field(default_factory=dict)  # further Compose keys, as Compose spells them


@dataclass(frozen=True)
class Kind:
    """One program that can serve a declaration: the same subjects, role, permissions and
    contract, another implementation behind them (an engine: the built-in one, or another)."""

    name: str
    setup: str  # "module:function", imported only when a process of this kind starts
    summary: str


@dataclass(frozen=True)
class Service:
    """One kind of process (or, `runs="driver"`, a library that runs inside a CLI command and
    shares a role with a kind of process)."""

    name: str  # its process name, and its role's unless `role` says otherwise
    summary: str  # one line: what it does (its --help)
    runs: Runs
    config: type[ServiceConfig] | None = None
    setup: str = ""  # "module:function", imported only when the service starts
    role: str = ""  # the bus credential it runs under; "" for `name`
    listens: Mapping[str, Listen] = field(default_factory=dict)  # by the name setup binds
    subscribes: tuple[Subject, ...] = ()  # read outside an endpoint (a client's own subscription)
    publishes: tuple[Subject, ...] = ()
    owns: tuple[Store, ...] = ()  # streams it creates, updates and consumes
    reads: tuple[Store, ...] = ()  # streams it reads single records of
    lists: tuple[Store, ...] = ()  # streams it walks with an ordered consumer (a bucket's keys)
    # The key its stats endpoint answers on (Runtime.stats_key): its name, or for a kind with many
    # processes their scope in tokens, which the role's permission can scope.
    stats: Callable[[Scope], str] | None = None
    client: bool = False  # it calls the router: the router may stream into its inboxes
    to_clients: bool = False  # it streams into clients' inboxes (the router)
    # One credential for every engine too (a supervisor of all of them); per-engine roles always
    # have one credential per engine.
    all_engines: bool = False
    scopes: Callable[[Any], tuple[Scope, ...]] = lambda config: (Scope(),)
    process: Callable[[Scope], str] | None = None  # its process name; None for `name`
    signals_during_setup: bool = True
    compose: Compose | None = None  # None: not a container of compose.yaml (another service runs it)
    up: Callable[[Deployment], Sequence[Planned]] | None = None  # its processes under `belayer up`
    # Fields of its config that `belayer up` takes as flags of its own and passes on (to this
    # service, and to any config that repeats the field with same_as); `up_flags` renames a flag.
    up_settings: tuple[str, ...] = ()
    up_flags: Mapping[str, str] = field(default_factory=dict)
    # The programs that can serve it, picked by its config's `kind`; the first is `setup` itself.
    # Empty: `setup` alone. A new engine is a kind here, not a new service.
    kinds: tuple[Kind, ...] = ()

    def __post_init__(self) -> None:
        if self.kinds:
            fields = dataclasses.fields(self.config) if self.config is not None else ()
            default = next((f.default for f in fields if f.name == "kind"), None)
            if self.kinds[0].setup != self.setup or default != self.kinds[0].name:
                raise TypeError(
                    f"{self.name}: its first kind is its setup, and its config's `kind` defaults to it"
                )

    def setup_of(self, settings: Any) -> str:
        """The setup of the program that serves `settings` (its `kind`, for a service with kinds)."""
        if not self.kinds:
            return self.setup
        for kind in self.kinds:
            if kind.name == settings.kind:
                return kind.setup
        known = ", ".join(kind.name for kind in self.kinds)
        raise ConfigError(f"--kind {settings.kind!r}: {self.name} comes in {known}")

    @property
    def role_name(self) -> str:
        return self.role or self.name

    @property
    def replies(self) -> bool:
        return any(listen.reply is not None for listen in self.listens.values())

    def endpoints(
        self, names: Subjects, config: Any, **handlers: Callable[..., Awaitable[Message | None]]
    ) -> list[Endpoint]:
        """The runtime endpoints of the listens named in `handlers`, one per scope of `config`."""
        unknown = sorted(set(handlers) - set(self.listens))
        if unknown:
            raise TypeError(f"{self.name} declares no endpoint {', '.join(unknown)}")
        return [
            Endpoint(
                listen.subject(names, scope),
                listen.accepts,
                handler,
                reply=listen.reply is not None,
                concurrent=listen.concurrent,
                with_subject=listen.with_subject,
            )
            for scope in self.scopes(config)
            for name, handler in handlers.items()
            for listen in (self.listens[name],)
        ]

    def stats_key(self, scope: Scope) -> str:
        """Where its processes answer StatsRequest; "" for a driver (no runtime of its own)."""
        if self.runs == "driver":
            return ""
        return self.stats(scope) if self.stats else self.name

    def process_name(self, scope: Scope) -> str:
        return self.process(scope) if self.process else self.name

    @property
    def module(self) -> str:
        """What `python -m` runs: the package its setup lives in."""
        return self.setup.split(":")[0].rsplit(".", 1)[0]


def stats_keys(
    services: Sequence[Service], engines: Mapping[str, Sequence[int]], hosts: Sequence[str]
) -> list[str]:
    """The stats keys of every process the declarations describe (`belayer status`), for the
    engines it knows (each with its workers' pids) and the hosts it knows. A trainer's group
    workers are left out: they live for one training run, and the trainer reports them."""
    keys: list[str] = []
    for service in services:
        if service.runs == "engine":
            scopes = [Scope(engine=e, pid=str(pid)) for e, pids in engines.items() for pid in pids]
        elif service.runs == "host":
            scopes = [Scope(host=host) for host in hosts]
        elif service.runs == "cluster":
            scopes = [Scope()]
        else:
            scopes = []
        keys += [service.stats_key(scope) for scope in scopes]
    return list(dict.fromkeys(keys))  # one per key: the servers of every host answer as one


def up_settings(services: Sequence[Service]) -> type:
    """The config class of what `belayer up` takes as flags and passes on to its services: a field
    for each name in a declaration's `up_settings`, the service's own field repeated (same_as:
    its type, default and help), under `up_flags`' name where one is given. A field that two
    declarations both name is refused: one flag cannot set two things."""
    fields: list[tuple[str, Any, Any]] = []
    named_by: dict[str, str] = {}
    for service in services:
        if not service.up_settings:
            continue
        if service.config is None or not set(service.up_flags) <= set(service.up_settings):
            raise TypeError(f"{service.name}: up_settings need a config, and up_flags rename only those")
        hints = typing.get_type_hints(service.config)
        for name in service.up_settings:
            if name in named_by:
                raise TypeError(f"{service.name} and {named_by[name]} both pass on {name!r}")
            named_by[name] = service.name
            flag = service.up_flags[name] if name in service.up_flags else ""
            choices = tuple(kind.name for kind in service.kinds) if name == "kind" else ()
            fields.append((name, hints[name], same_as(service.config, name, flag=flag, choices=choices)))
    return dataclasses.make_dataclass("UpSettings", fields, frozen=True, kw_only=True)


def main(service: Service, argv: list[str] | None = None) -> None:
    """Every service's `python -m belayer_rl.services.<name>`: its flags, then the runtime."""
    if service.config is None or not service.setup:
        raise TypeError(f"{service.name} is no process of its own")
    settings = parse_flags(service.config, argv, prog=f"belayer-{service.name}", description=service.summary)
    try:
        module, function = service.setup_of(settings).split(":")
    except ConfigError as exc:
        raise SystemExit(f"belayer-{service.name}: {exc}") from None
    setup = getattr(importlib.import_module(module), function)
    scope = (*service.scopes(settings), Scope())[0]  # a process of several scopes: its first names it
    runtime.run(
        service.process_name(scope),
        settings,
        setup,
        signals_during_setup=service.signals_during_setup,
        stats_key=service.stats_key(scope),
    )
