"""Environment failures are not observations; timeouts really stop actions; FIFO under concurrency."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import aiodocker
import msgspec
import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.linux import HOST_CGROUPS, has_capability
from belayer_rl.services.checkpointer.sandbox import CAP_SYS_RESOURCE, LABEL_HOST, LABEL_SANDBOX
from belayer_rl.shared import protocol
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import EnvFailure, SandboxSpec
from belayer_rl.shared.subjects import Subjects
from tests.support import poll

from .conftest import ROOT, Service
from .helpers import events, freeze_behind_dockers_back, init_pid, kill_container

NAMES = Subjects()  # the default cluster's names


async def test_exit_137_is_an_observation(client: SandboxClient, image: str) -> None:
    await client.create(SandboxSpec(image=image), sandbox="o")
    result = await client.exec("o", "echo out; echo err >&2; kill -KILL $$")
    assert (result.exit_code, result.stdout, result.timed_out) == (137, "out\n", False)
    child = await client.exec("o", "sleep 30 & kill -KILL $!; wait $!; echo child=$?")
    assert child.stdout == "child=137\n" and child.exit_code == 0
    assert (await client.exec("o", "exit 3")).exit_code == 3


async def test_an_action_printing_nul_bytes_gets_a_bounded_observation(
    client: SandboxClient, image: str
) -> None:
    """Each NUL takes six bytes on the wire (\\u0000): 256 KiB of them, under the cap on bytes
    read, made a reply of 1.5 MiB that the bus dropped, and the trajectory met `wrong-step` next.
    The observation is cut to fit instead, flagged, and the sandbox goes on."""
    await client.create(SandboxSpec(image=image), sandbox="z")
    result = await client.exec("z", "head -c 200000 /dev/zero; head -c 200000 /dev/zero >&2; echo done")
    assert result.truncated and result.step == 1
    assert 0 < len(result.stdout) < 200_000 and set(result.stdout) == {"\0"}
    assert 0 < len(result.stderr) < 200_000 and set(result.stderr) == {"\0"}
    assert len(protocol.encode(result)) < protocol.MAX_MESSAGE_BYTES
    after = await client.exec("z", "echo next")
    assert (after.step, after.stdout, after.truncated) == (2, "next\n", False)


def test_encoded_text_keeps_the_longest_prefix_that_fits() -> None:
    for data, budget in [(b"\0" * 100, 62), (b"ab\xff" * 50, 40), (b'"\n' * 30, 33), (b"plain", 64)]:
        text, cut = protocol.encoded_text(data, budget)
        whole = data.decode(errors="replace")
        assert whole.startswith(text) and cut == (text != whole)
        assert len(msgspec.json.encode(text)) <= budget
        if cut:  # one more character would not fit
            assert len(msgspec.json.encode(whole[: len(text) + 1])) > budget
    assert protocol.encoded_text(b"\0" * 100, 62) == ("\0" * 10, True)  # 2 quotes + 10 x 6 bytes


async def test_timeout_kills_the_whole_action(client: SandboxClient, image: str) -> None:
    await client.create(SandboxSpec(image=image), sandbox="t")
    started = time.monotonic()
    result = await client.exec("t", "sleep 1000 & sleep 1000; echo never", timeout_s=1.0)
    assert result.timed_out and result.exit_code == 137 and "never" not in result.stdout
    assert time.monotonic() - started < 4.0
    left = await client.exec("t", "ps -o args | grep -c '^sleep 1000' || true")
    assert left.stdout.strip() == "0"  # the background child of the action died with it
    assert (await client.exec("t", "echo alive")).stdout == "alive\n"


ESCAPES = {
    "setsid": "setsid sh -c 'sleep 1000' </dev/null >/dev/null 2>&1 & sleep 1000",  # a new session
    "job-control": "sh -m -c 'sleep 1000 & wait'",  # each job its own process group
    "double-fork": "(sh -c 'setsid sleep 1000 &') ; sleep 1000",
    # The watcher: `/bin/sh -c sleep "$1"; kill ...` (its own words; the wrapper's are other).
    "watcher-killed": 'kill -9 $(ps -o pid,args | awk \'$2 == "/bin/sh" && $4 == "sleep" {print $1}\'); sleep 1000',
}


async def test_a_timeout_is_enforced_from_outside_the_container(client: SandboxClient, image: str) -> None:
    """Each way out of the in-container watcher's kill: the action still ends as the agent's own
    timeout, and nothing it started lives on. A background job of an action that ended in time is
    the agent's business and stays (so the sweep is no blanket kill)."""
    await client.create(SandboxSpec(image=image), sandbox="esc")
    kept = await client.exec("esc", "sleep 2000 </dev/null >/dev/null 2>&1 & echo started", timeout_s=10)
    assert kept.stdout == "started\n"
    for name, command in ESCAPES.items():
        started = time.monotonic()
        result = await client.exec("esc", command, timeout_s=1.0)
        assert result.timed_out, (name, result)
        assert time.monotonic() - started < 6.0, name
        left = await client.exec("esc", "ps -o args | grep -c '^sleep 1000' || true")
        assert left.stdout.strip() == "0", name
    still = await client.exec("esc", "ps -o args | grep -c '^sleep 2000' || true")
    assert still.stdout.strip() == "1"


async def test_background_job_holding_the_stream_does_not_block(client: SandboxClient, image: str) -> None:
    await client.create(SandboxSpec(image=image), sandbox="bg")
    started = time.monotonic()
    result = await client.exec("bg", "sleep 20 & echo started", timeout_s=30)
    assert result.stdout == "started\n" and time.monotonic() - started < 5.0


async def test_oom_kill_is_an_environment_failure(
    client: SandboxClient, service: Service, image: str
) -> None:
    await client.create(SandboxSpec(image=image, memory_mb=32), sandbox="oom")
    async with events(service.nats_url) as seen:
        with pytest.raises(ServiceError) as failed:
            await client.exec("oom", "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo survived")
    assert failed.value.code == "env-failure" and "oom" in failed.value.message
    assert any(isinstance(e, EnvFailure) and e.reason == "oom-killed" and e.sandbox == "oom" for e in seen)
    with pytest.raises(ServiceError) as still:
        await client.exec("oom", "echo hi")
    assert still.value.code == "env-failure"


async def test_an_action_that_never_started_is_an_environment_failure(
    client: SandboxClient, service: Service, image: str
) -> None:
    """Docker reports an exec it could not start (a frozen container, a missing shell) as exit code
    126, with its own error as the output. That is not an observation. Mutation check, run by hand:
    without the check on the exec's pid, the second exec answers 126 and "OCI runtime exec failed"."""
    await client.create(SandboxSpec(image=image, user=ROOT), sandbox="gone")  # root may remove the shell
    await client.exec("gone", "rm /bin/sh")  # the wrapper runs every action under /bin/sh
    async with events(service.nats_url) as seen:
        with pytest.raises(ServiceError) as failed:
            await client.exec("gone", "echo never")
    assert failed.value.code == "env-failure" and "never started" in failed.value.message, failed.value
    assert any(isinstance(e, EnvFailure) and e.reason == "daemon-error" and e.step == 1 for e in seen)


async def test_external_kill_is_an_environment_failure(
    client: SandboxClient, service: Service, image: str
) -> None:
    info = await client.create(SandboxSpec(image=image), sandbox="ext")
    async with events(service.nats_url) as seen:
        action = asyncio.create_task(client.exec("ext", "sleep 30; echo never", timeout_s=60))
        await asyncio.sleep(1.0)
        await kill_container(info.container_id)
        with pytest.raises(ServiceError) as failed:
            await action
    assert failed.value.code == "env-failure"
    assert any(isinstance(e, EnvFailure) and e.reason == "dead" for e in seen)


async def test_a_sandbox_frozen_behind_dockers_back_is_thawed_at_start(
    client: SandboxClient, service: Service, image: str
) -> None:
    """The campaign once found a sandbox's cgroup frozen while Docker held it running, after a
    dockerd restart, and Docker's unpause answered "not paused". How it came about is not known
    (a paused container across a dockerd restart exits cleanly here), so the test freezes the
    cgroup itself. Every health check thaws such a sandbox, the one at a checkpointer's start
    included (mutation checked: without the thaw its cgroup stays frozen). A frozen sandbox can
    still be destroyed: here Docker's forced removal kills it."""
    info = await client.create(SandboxSpec(image=image), sandbox="iced")
    await client.exec("iced", "echo kept > /tmp/kept")
    pid = await init_pid(info.container_id)
    freeze_behind_dockers_back(pid)
    assert HOST_CGROUPS.frozen(pid) is not None
    service.kill()
    service.start()
    await service.ready(client)
    assert HOST_CGROUPS.frozen(pid) is None
    kept = await client.exec("iced", "cat /tmp/kept", timeout_s=10, expect_step=1)
    assert kept.stdout == "kept\n"

    freeze_behind_dockers_back(pid)
    await client.destroy("iced", timeout_s=30)
    assert (await client.list()).sandboxes == []
    assert not Path(f"/proc/{pid}").exists()  # its init died: the kill reached it


async def test_a_container_docker_cannot_remove_does_not_stop_the_checkpointer(
    client: SandboxClient, service: Service, image: str
) -> None:
    """A labelled container no record names is removed at start. After a dockerd restart its
    removal can fail for a while (the campaign saw an overlay "device or resource busy"), and the
    checkpointer then ended at every start, a crash loop that stalled every trajectory of the host.
    Here a file in the container's writable layer is made immutable, so Docker's removal really
    fails ("operation not permitted"). The checkpointer serves meanwhile, and removes the container
    once it can (mutation checked: with the removal awaited in reconcile, as before, it is never
    ready)."""
    service.kill()
    docker = aiodocker.Docker()
    try:
        labels = {LABEL_HOST: service.host_id, LABEL_SANDBOX: "never-recorded"}
        container = await docker.containers.run(
            {
                "Image": image,
                "Cmd": ["sleep", "1000"],
                "Labels": labels,
                "HostConfig": {"NetworkMode": "none"},
            }
        )
        upper = Path((await container.show())["GraphDriver"]["Data"]["UpperDir"])
        pinned = upper / "pinned"
        pinned.write_text("kept by chattr +i\n")
        await asyncio.to_thread(subprocess.run, ["chattr", "+i", str(pinned)], check=True)
        try:
            service.start()
            await service.ready(client)
            await client.create(SandboxSpec(image=image), sandbox="served")
            assert (await client.exec("served", "echo yes")).stdout == "yes\n"
            assert (await container.show())["Id"] == container.id  # its removal failed so far
        finally:
            await asyncio.to_thread(subprocess.run, ["chattr", "-i", str(pinned)], check=True)

        async def gone() -> bool | None:
            try:
                await container.show()
            except aiodocker.DockerError as exc:
                if exc.status == 404:
                    return True
            return None

        await poll(gone, timeout_s=60)
        assert service.process is not None and service.process.poll() is None
    finally:
        await docker.close()


async def test_fifo_on_one_sandbox(client: SandboxClient, image: str) -> None:
    await client.create(SandboxSpec(image=image), sandbox="fifo")
    calls = []
    for i in range(1, 13):
        calls.append(client.exec("fifo", f"echo {i} >> /tmp/order; sleep 0.0{i % 3}", expect_step=i - 1))
        if i % 4 == 0:
            calls.append(client.checkpoint("fifo", "traj-fifo", k=i))
    results = await asyncio.gather(*calls)
    steps = [r.step if hasattr(r, "step") else ("ckpt", r.k) for r in results]
    assert steps == [1, 2, 3, 4, ("ckpt", 4), 5, 6, 7, 8, ("ckpt", 8), 9, 10, 11, 12, ("ckpt", 12)]
    order = await client.exec("fifo", "cat /tmp/order")
    assert order.stdout.split() == [str(i) for i in range(1, 13)]


async def test_sixteen_sandboxes_at_once(client: SandboxClient, image: str) -> None:
    names = [f"m{i}" for i in range(16)]
    await asyncio.gather(*(client.create(SandboxSpec(image=image, memory_mb=64), sandbox=n) for n in names))

    async def drive(name: str) -> tuple[int, int, str]:
        await client.exec(name, f"echo {name} > /tmp/who")
        checkpoint = client.checkpoint(name, f"traj-{name}", k=1, context_tokens=[len(name)])
        second = client.exec(name, "cat /tmp/who", expect_step=1)
        done, result = await asyncio.gather(checkpoint, second)
        return done.k, result.step, result.stdout.strip()

    outcomes = await asyncio.gather(*(drive(n) for n in names))
    assert outcomes == [(1, 2, n) for n in names]
    listing = await client.list()
    assert sorted(s.sandbox for s in listing.sandboxes) == sorted(names)
    restored = await client.restore("traj-m3")
    assert (restored.source, restored.k) == ("latest", 1)
    assert (await client.exec("m3", "cat /tmp/who", expect_step=1)).stdout == "m3\n"


async def test_gc_budget_keeps_latest_and_end_deletes_all(service: Service, image: str) -> None:
    from belayer_rl.shared import bus

    service.stop()
    service.start("--disk-budget-gb", "0.000001")  # about 1 KiB: only each trajectory's latest fits
    nc = await bus.connect(service.nats_url, "test-client")
    client = SandboxClient(nc, service.host_id)
    try:
        await service.ready(client)
        await client.create(SandboxSpec(image=image), sandbox="gc")
        ids = []
        for k in (1, 2, 3):
            await client.exec("gc", f"echo {k} > /tmp/k")
            ids.append((await client.checkpoint("gc", "traj-gc", k=k)).checkpoint_id)
        folder = service.state_dir / "checkpoints" / "traj-gc"
        assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == [ids[-1]]
        restored = await client.restore("traj-gc")
        assert (restored.source, restored.k) == ("latest", 3)
        await client.end("traj-gc")
        assert not folder.exists()
        with pytest.raises(ServiceError) as gone:
            await client.restore("traj-gc")
        assert gone.value.code == "no-checkpoint"
    finally:
        await nc.close()


async def test_idle_sandbox_death_is_reported_without_an_action(
    client: SandboxClient, service: Service, image: str
) -> None:
    info = await client.create(SandboxSpec(image=image), sandbox="idle")
    async with events(service.nats_url) as seen:
        await kill_container(info.container_id)
        for _ in range(50):
            if any(isinstance(e, EnvFailure) and e.sandbox == "idle" for e in seen):
                break
            await asyncio.sleep(0.1)
    failures = [e for e in seen if isinstance(e, EnvFailure) and e.sandbox == "idle"]
    assert len(failures) == 1 and failures[0].reason == "dead"
    listing = await client.list()
    assert [s.state for s in listing.sandboxes if s.sandbox == "idle"] == ["failed"]


async def test_create_errors_are_typed_and_leave_nothing(client: SandboxClient, image: str) -> None:
    with pytest.raises(ServiceError) as missing:
        await client.create(SandboxSpec(image="belayer-no-such-image:nope"), sandbox="x")
    assert missing.value.code == "no-image"
    assert (
        "'belayer-no-such-image:nope'" in missing.value.message
        and "builds belayer-sandbox:test" in missing.value.message
    )
    with pytest.raises(ServiceError) as bad:
        await client.create(SandboxSpec(image=image, cap_add=["NOT_A_CAP"]), sandbox="x")
    assert bad.value.code == "not-allowed"
    assert (await client.list()).sandboxes == []
    info = await client.create(
        SandboxSpec(image=image, memory_mb=96, pids_limit=40), sandbox="x"
    )  # free again
    assert info.state == "running"
    with pytest.raises(ServiceError) as taken:
        await client.create(SandboxSpec(image=image), sandbox="x")
    assert taken.value.code == "exists"
    spec = await client.exec("x", "cat /proc/1/status | grep -E '^(CapEff|NoNewPrivs)'; ls /sys/class/net")
    assert "CapEff:\t0000000000000000" in spec.stdout and "NoNewPrivs:\t1" in spec.stdout
    assert spec.stdout.split()[-1] == "lo"  # no network but loopback
    limits = await client.exec(
        "x",
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null;"
        " cat /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max 2>/dev/null",
    )
    assert limits.stdout.split() == [str(96 << 20), "40"]


REACHING_INTO_THE_HOST: list[tuple[dict[str, object], str]] = [
    ({"cap_add": ["SYS_ADMIN"]}, "SYS_ADMIN"),
    ({"cap_add": ["ALL"]}, "ALL"),
    ({"cap_add": ["CHOWN", "SYS_MODULE"]}, "SYS_MODULE"),
    ({"cap_add": ["DAC_READ_SEARCH"]}, "DAC_READ_SEARCH"),
    ({"network": True}, "network"),
    ({"memory_mb": 1024}, "memory_mb"),
    ({"cpus": 2.0}, "cpus"),
    ({"user": "root"}, "allow-root-user"),
    ({"user": "0:0"}, "allow-root-user"),
    ({"user": "00"}, "allow-root-user"),  # runc reads "00" as uid 0
]


async def test_a_sandbox_cannot_be_configured_into_the_host(
    client: SandboxClient, service: Service, image: str
) -> None:
    """On a host that allows 512 MB and 1 CPU per sandbox, 2 sandboxes and no network: what reaches
    past that is refused before any container exists, with the reason; an allowed capability and
    the host's own bounds run (so the check is no blanket refusal), and a third sandbox is refused."""
    service.stop()
    service.allow_root_user = False
    service.start("--sandbox-memory-mb", "512", "--sandbox-cpus", "1", "--max-sandboxes", "2")
    await service.ready(client)
    for changes, named in REACHING_INTO_THE_HOST:
        with pytest.raises(ServiceError) as refused:
            await client.create(msgspec.structs.replace(SandboxSpec(image=image, memory_mb=64), **changes))
        assert refused.value.code == "not-allowed" and named in refused.value.message, refused.value
    assert (await client.list()).sandboxes == []
    allowed = SandboxSpec(image=image, memory_mb=512, cpus=1.0, cap_add=["NET_BIND_SERVICE"])
    assert (await client.create(allowed, sandbox="a")).state == "running"
    await client.create(SandboxSpec(image=image, memory_mb=64), sandbox="b")
    with pytest.raises(ServiceError) as full:
        await client.create(SandboxSpec(image=image, memory_mb=64), sandbox="c")
    assert full.value.code == "host-full"


async def test_actions_run_as_the_images_user_and_a_dump_it_cannot_make_says_why(
    client: SandboxClient, image: str
) -> None:
    """The test image's USER is nobody: every action runs as it, before and after a restore, while
    the checkpointer's idle init runs as root, so a sandbox whose actions have ended is
    checkpointed on any host. A process an action leaves running as nobody can be dumped only where
    the host's root has CAP_SYS_RESOURCE (CRIU reads every dumped process's limits); elsewhere (this
    project's CI machines) the checkpoint fails saying so, and the sandbox runs on. A user that is
    no name is refused at the edge. Mutations, run by hand: without the exec's `User`, or without the
    image's USER written into the spec, `id -u` answers 0; with the init run as the spec's user,
    /proc/1 belongs to nobody."""
    await client.create(SandboxSpec(image=image), sandbox="nobody")
    who = await client.exec(
        "nobody", "id -u; id -g; stat -c %u /proc/1; touch /etc/x 2>&1; echo mine > /tmp/f"
    )
    lines = who.stdout.splitlines()
    assert lines[:3] == ["65534", "65534", "0"] and "Permission denied" in lines[3], who
    assert (await client.checkpoint("nobody", "traj-nobody", k=1)).k == 1
    await client.exec("nobody", "sleep 1000 </dev/null >/dev/null 2>&1 &", expect_step=1)
    if has_capability(CAP_SYS_RESOURCE):
        assert (await client.checkpoint("nobody", "traj-nobody", k=2)).k == 2
    else:
        with pytest.raises(ServiceError) as refused:
            await client.checkpoint("nobody", "traj-nobody", k=2)
        assert refused.value.code == "checkpoint-failed" and "CAP_SYS_RESOURCE" in refused.value.message
    restored = await client.restore("traj-nobody")  # its latest checkpoint: k=2 or k=1
    after = await client.exec("nobody", "id -u; cat /tmp/f", expect_step=restored.k)
    assert after.stdout == "65534\nmine\n"
    with pytest.raises(msgspec.ValidationError, match="user"):
        msgspec.convert({"image": image, "user": "0;rm -rf /"}, type=SandboxSpec)


async def test_oom_killed_init_is_an_oom_environment_failure(
    client: SandboxClient, service: Service, image: str
) -> None:
    """Docker may report the init's exit ("die") before its OOM kill ("oom"), and a dead init
    leaves no cgroup to count kills in (CI saw "dead" so): a SIGKILLed init is asked about once
    more. Which order comes cannot be chosen, so this test catches the race only when it comes."""
    spec = SandboxSpec(image=image, memory_mb=48, cmd=["/bin/sh", "-c", "sleep 1; exec memhold 200"])
    async with events(service.nats_url) as seen:
        await client.create(spec, sandbox="oominit")
        for _ in range(300):
            if any(isinstance(e, EnvFailure) and e.sandbox == "oominit" for e in seen):
                break
            await asyncio.sleep(0.1)
    failures = [e for e in seen if isinstance(e, EnvFailure) and e.sandbox == "oominit"]
    assert [f.reason for f in failures] == ["oom-killed"]
    with pytest.raises(ServiceError) as failed:
        await client.exec("oominit", "echo hi")
    assert failed.value.code == "env-failure"


async def test_malformed_requests_get_error_replies(client: SandboxClient, service: Service) -> None:
    from belayer_rl.shared import protocol
    from belayer_rl.shared.protocol import ErrorReply, SandboxList

    decoder = protocol.decoder_for(ErrorReply)
    for verb, payload in [
        ("exec", b"not json"),
        ("exec", b'{"type":"sandbox_exec","sandbox":"../etc","command":"true"}'),
        ("create", protocol.encode(SandboxList())),  # a valid message on the wrong verb
        ("exec", b'{"type":"sandbox_exec","v":99,"sandbox":"a","command":"true"}'),
    ]:
        reply = await client.nc.request(NAMES.sandbox_rpc(service.host_id, verb, "cli"), payload, timeout=5)
        assert protocol.decode(decoder, reply.data).code == "bad-request"
    assert (await client.list()).sandboxes == []  # still serving
