"""Who may do what on the bus: one role per kind of process, as nats-server permissions.

The bus enforces this, not the receivers' goodwill: a worker's credential can publish only its own
engine's chunks and heartbeats, only the checkpointer writes prefix pointers and checkpoint
objects, only the rollout side reaches the sandboxes, and no worker or CLI credential can purge,
delete or update a stream, a bucket or an object store. Every role subscribes to its own inbox
only (`_INBOX.<its public key>.>`, shared/access.py), so nobody reads another's replies, and
replies to requests go back through `allow_responses`, which needs no publish right on inboxes.

A service's role is made from its declaration (shared/declaration.py: what it listens to,
publishes, owns and reads), and from nothing else, so a permission cannot drift from what the
service does. This file writes only the users no declaration describes: the `belayer up` daemon
(`cluster`), the rollout side and its users (`cli`), and the operator (`admin`). `{engine}` in a
role's subjects is filled per engine: each engine has its own credential, and so has each
engine's shadow supervisor.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import nkeys

from belayer_rl.shared import files
from belayer_rl.shared.access import inbox_prefix, public_key, write_api_keys
from belayer_rl.shared.declaration import PERMISSION_SCOPE, Service, Subject, kv_stream
from belayer_rl.shared.subjects import Subjects

# The key that signs checkpoint manifests (services/checkpointer/store.py): 32 random bytes in hex.
# Not a bus credential, but a secret every checkpointer of the cluster shares, so it is made here.
CHECKPOINT_KEY_FILE = "checkpoint.key"
ALL_ENGINES = "*"  # the engine of a user that serves every engine (User.engine)


@dataclass(frozen=True)
class Role:
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    replies: bool = False  # may answer requests it received (services)
    # Streams (by their JetStream name) it may create, read, consume and update through $JS.API.
    streams: tuple[str, ...] = ()
    # Streams it may only read (stream info and direct/last-message gets).
    reads: tuple[str, ...] = ()
    # Streams it may also list through an ordered consumer of its own (a bucket's keys).
    lists: tuple[str, ...] = ()
    everything: bool = False  # the operator's own credential
    # The stats keys it answers (Runtime.stats_key): a name, or tokens with wildcards.
    stats: tuple[str, ...] = ()
    client: bool = False  # the rollout side: the router may stream into its users' inboxes
    # Also users `<role>-<name>`, one per client named to `belayer creds --clients`: each owns the
    # requests it starts ({client} in a subject is the user's name).
    named_clients: bool = False
    to_clients: bool = False  # may publish into the clients' inboxes (the router)
    # One user per engine, `<role>-<engine>`, whose subjects' {engine} tokens name that engine.
    per_engine: bool = False
    # Also one user `<role>` for every engine: each token that names {engine} is `*` for it.
    all_engines: bool = False


def _js_api(stream: str) -> list[str]:
    """The $JS.API subjects that manage and consume one stream: STREAM.{INFO,CREATE,UPDATE,...}
    and CONSUMER.CREATE name the stream after two tokens, STREAM.MSG.GET after three."""
    return [
        f"$JS.API.*.*.{stream}",
        f"$JS.API.*.*.{stream}.>",
        f"$JS.API.*.*.*.{stream}",
        f"$JS.API.CONSUMER.*.*.{stream}.>",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _js_list(stream: str) -> list[str]:
    """An ordered consumer's life: created, asked about, deleted, its flow control answered."""
    return [
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.*",
        f"$JS.API.CONSUMER.DELETE.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]


def _js_read(stream: str) -> list[str]:
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
    ]


def service_role(services: Sequence[Service], s: Subjects) -> Role:
    """The role of the services that share one credential (a process and the driver beside it):
    what their declarations say they subscribe to, publish, own and read, nothing more."""

    def fill(subject: Subject) -> str:
        return subject(s, PERMISSION_SCOPE)

    return Role(
        publish=tuple(fill(subject) for service in services for subject in service.publishes),
        subscribe=tuple(
            fill(subject)
            for service in services
            for subject in (*(listen.subject for listen in service.listens.values()), *service.subscribes)
        ),
        replies=any(service.replies for service in services),
        streams=tuple(store(s) for service in services for store in service.owns),
        reads=tuple(store(s) for service in services for store in service.reads),
        lists=tuple(store(s) for service in services for store in service.lists),
        stats=tuple(key for service in services if (key := service.stats_key(PERMISSION_SCOPE))),
        client=any(service.client for service in services),
        to_clients=any(service.to_clients for service in services),
        per_engine=any(service.runs == "engine" for service in services),
        all_engines=any(service.all_engines for service in services),
    )


def role_table(services: Sequence[Service], s: Subjects) -> dict[str, Role]:
    """Every role of cluster `s.cluster_id`: each declared service's, then the users of this file."""
    by_role: dict[str, list[Service]] = {}
    for service in services:
        by_role.setdefault(service.role_name, []).append(service)
    table = {name: service_role(members, s) for name, members in by_role.items()}
    r = s.root
    engines = s.engine_registry_bucket
    pointers = s.prefix_pointer_bucket
    return table | {
        "cluster": Role(  # the `belayer up` daemon: reports its children's exits
            publish=(s.event("process", "*"), s.event("worker_failed", "*")),
        ),
        "cli": Role(  # a user, the rollout driver: the rollout side
            publish=(
                s.router_generate("{client}"),
                s.router_attach("{client}"),
                s.router_cancel("{client}"),
                s.router_status,
                s.router_keepalive("{client}"),
                f"{r}.sandbox.*.*.{{client}}",
                s.policy_decide,
                s.event("env_step", "*"),
                s.event("llm_response", "*"),
                s.event("checkpoint_timeout", "*"),
                s.event("policy_fallback", "*"),
                s.event("chaos_kill", "*"),
                s.weights_list,
                s.weights_handles,
                s.weights_publish,
                s.event("model_published", "*"),  # `belayer model publish`: new weights for vLLM engines
                s.engine_unquarantine("*"),  # `belayer engines unquarantine`: the operator's call
                # every service's stats (`belayer status`): a name, or a family's tokens
                f"{r}.svc.*.stats",
                f"{r}.svc.*.*.stats",
                f"{r}.svc.*.*.*.stats",
            ),
            subscribe=(s.events_all,),
            reads=(kv_stream(engines), kv_stream(pointers)),
            client=True,
            named_clients=True,
        ),
        "admin": Role(everything=True, client=True),  # benchmarks and operators: may purge and delete
    }


@dataclass(frozen=True)
class User:
    name: str  # the role, or <role>-<engine> (engine-e0, shadow-supervisor-e0)
    role: str
    seed: str
    engine: str = ""  # "" for a role without engines, ALL_ENGINES for its every-engine user

    @property
    def public_key(self) -> str:
        return public_key(self.seed)


@dataclass
class Credentials:
    """The users of one cluster, each with a fresh nkey; `services`: the declarations their roles
    are made from (belayer_rl.services.SERVICES)."""

    services: tuple[Service, ...]
    subjects: Subjects
    engines: tuple[str, ...]
    users: list[User] = field(default_factory=list)
    api_keys: tuple[str, ...] = ("default",)  # the gateway's API keys, by name (shared/access.py)

    @property
    def table(self) -> dict[str, Role]:
        return role_table(self.services, self.subjects)

    @classmethod
    def generate(
        cls,
        services: Sequence[Service],
        subjects: Subjects,
        engines: tuple[str, ...],
        clients: tuple[str, ...] = (),
        api_keys: tuple[str, ...] = ("default",),
    ) -> Credentials:
        creds = cls(tuple(services), subjects, engines, api_keys=api_keys)
        for name, role in creds.table.items():
            if role.named_clients:
                creds.users += [User(f"{name}-{c}", name, new_seed()) for c in clients]
            if role.per_engine:
                creds.users += [User(f"{name}-{e}", name, new_seed(), engine=e) for e in engines]
            if role.all_engines:
                creds.users.append(User(name, name, new_seed(), engine=ALL_ENGINES))
            elif not role.per_engine:
                creds.users.append(User(name, name, new_seed()))
        return creds

    @classmethod
    def load(cls, services: Sequence[Service], folder: Path, subjects: Subjects) -> Credentials:
        """The users whose seeds `write` left in `folder`, one `<user>.creds` each: a role's name,
        or <role>-<engine> for a role with one user per engine. ValueError for a file that names
        no role."""
        table = role_table(services, subjects)
        users = []
        for path in sorted(folder.glob("*.creds")):
            role, engine = user_role(path.stem, table)
            users.append(User(path.stem, role, path.read_text().strip(), engine=engine))
        return cls(tuple(services), subjects, tuple(u.engine for u in users if u.role == "engine"), users)

    def rotate(self, name: str) -> None:
        """A fresh key for the user `name`; every other user keeps its own. Once the server has
        read the new auth.conf, the old key is refused and its connections are closed."""
        names = [u.name for u in self.users]
        if name not in names:
            raise ValueError(f"no user {name!r}; one of {', '.join(names)}")
        self.users = [replace(u, seed=new_seed()) if u.name == name else u for u in self.users]

    def users_entries(self) -> list[dict[str, object]]:
        table = self.table
        inboxes = [f"{inbox_prefix(u.public_key)}.>" for u in self.users if table[u.role].client]
        return [permissions(user, table[user.role], self.subjects, inboxes) for user in self.users]

    def authorization(self) -> str:
        return authorization(self)

    def write(self, folder: Path) -> dict[str, Path]:
        """auth.conf, one `<user>.creds` seed file per user, the checkpointers' shared
        checkpoint.key and the gateway's API keys, all mode 0600; returns the paths of the seeds
        and of the new API keys. An existing checkpoint.key is kept (a new one would disown every
        checkpoint signed with it), and so is an existing API key."""
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        paths = {}
        for user in self.users:
            paths[user.name] = private_file(folder / f"{user.name}.creds", user.seed + "\n")
        private_file(folder / "auth.conf", self.authorization())
        if not (folder / CHECKPOINT_KEY_FILE).exists():
            private_file(folder / CHECKPOINT_KEY_FILE, secrets.token_hex(32) + "\n")
        paths |= {f"api key {name}": path for name, path in write_api_keys(folder, self.api_keys).items()}
        return paths


def authorization(*clusters: Credentials) -> str:
    """An nats-server config block for the users of one or more clusters on one server; include it
    from the server's config."""
    users = [entry for cluster in clusters for entry in cluster.users_entries()]
    # JSON is a valid nats-server config value: no quoting rules of our own.
    return "authorization {\n  users = " + json.dumps(users, indent=2) + "\n}\n"


def permissions(user: User, role: Role, s: Subjects, client_inboxes: list[str]) -> dict[str, object]:
    """`client_inboxes`: the inboxes of this cluster's rollout-side users, where the router may
    stream (not any inbox on the server: a client of another cluster, or of another role)."""
    entry: dict[str, object] = {"nkey": user.public_key}
    if role.everything:
        return entry

    def fill(subject: str) -> str:
        return fill_engine(subject, user.engine).replace("{client}", user.name)

    publish = [fill(p) for p in role.publish]
    if role.to_clients:
        publish += client_inboxes
    for stream in role.streams:
        publish += _js_api(stream)
    for stream in role.reads:
        publish += _js_read(stream)
    for stream in role.lists:
        publish += _js_list(stream)
    subscribe = [fill(p) for p in role.subscribe]
    subscribe.append(f"{inbox_prefix(user.public_key)}.>")
    # a service answers the runtime's stats endpoint, its own only
    subscribe += [s.service_stats(fill(key)) for key in role.stats]
    allowed: dict[str, object] = {
        # An empty allow list would allow everything: a role that publishes nothing of its own
        # (it only replies) gets one subject nobody listens to.
        "publish": {"allow": sorted(set(publish)) or [f"{s.root}.nothing"]},
        "subscribe": {"allow": sorted(set(subscribe))},
    }
    if role.replies:
        allowed["allow_responses"] = True
    entry["permissions"] = allowed
    return entry


def fill_engine(subject: str, engine: str) -> str:
    """`subject` for one engine; for ALL_ENGINES, each token that names {engine} becomes `*` (a
    NATS wildcard matches whole tokens only: `worker-*-main` would be a literal)."""
    if engine == ALL_ENGINES:
        return ".".join("*" if "{engine}" in token else token for token in subject.split("."))
    return subject.replace("{engine}", engine)


def user_role(name: str, table: dict[str, Role]) -> tuple[str, str]:
    """The role and engine of the user `name`: a role's own name, or <role>-<engine>."""
    if name in table:
        role = table[name]
        if role.per_engine and not role.all_engines:
            raise ValueError(f"{name}.creds: role {name!r} has one user per engine, {name}-<engine>")
        return name, ALL_ENGINES if role.per_engine else ""
    for role_name, role in table.items():
        if name.startswith(f"{role_name}-") and len(name) > len(role_name) + 1:
            if role.per_engine:
                return role_name, name.removeprefix(f"{role_name}-")
            if role.named_clients:
                return role_name, ""
    raise ValueError(
        f"{name}.creds: {name!r} is no role ({', '.join(sorted(table))}), <role>-<engine> nor cli-<client>"
    )


def new_seed() -> str:
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode()


def private_file(path: Path, text: str) -> Path:
    """Written mode 0600 from the start: a secret is never readable by others, even briefly. A
    file it replaces keeps its owner (a Compose service's uid, `compose_owners`)."""
    return files.write_whole(path, text.encode(), mode=0o600, keep_owner=True)


# Under Compose each service runs as a uid of its own (its declaration's `Compose.uid`; the i-th
# engine's container as that uid + i), and that uid owns its own secrets only: in the pid namespace
# the servers and engines share, a process of one container cannot open another's
# /proc/<pid>/root/run/secrets, nor read the file if it could. Each uid is also its group.
NATS_UID = 2000  # the bus's container: it reads auth.conf


def secret_files(service: Service, engine: str = "") -> tuple[str, dict[str, str]]:
    """What a service's container reads from the credentials folder: its role's credential, and
    the other files its Compose declaration names (file -> the name it reads it under)."""
    assert service.compose is not None
    own = f"{service.role_name}-{engine}.creds" if engine else f"{service.role_name}.creds"
    others = {
        file.replace("{engine}", engine): target.replace("{engine}", engine)
        for file, target in service.compose.secrets.items()
    }
    return own, others


def compose_owners(services: Sequence[Service], folder: Path, engines: tuple[str, ...]) -> dict[Path, int]:
    """The uid that owns each file of a credentials folder under Compose. Files no container
    reads (cli, admin, cluster, the every-engine supervisor) stay the writer's."""
    by_file = {"auth.conf": NATS_UID}
    for service in services:
        c = service.compose
        if c is None:
            continue
        placed = [(e, c.uid + i) for i, e in enumerate(engines)] if c.per_engine else [("", c.uid)]
        for engine, uid in placed:
            own, others = secret_files(service, engine)
            by_file |= dict.fromkeys([own, *others], uid)
    return {folder / name: uid for name, uid in by_file.items() if (folder / name).exists()}
