"""The host's sandbox policy holds whatever the image or the request says (trust finding 7).

A real checkpointer (its own process, a real dockerd) on a host that does not allow root. Each
attack is a request any rollout-side credential may send: an image that names no USER, an image
whose USER is a name that its own /etc/passwd maps to uid 0, a restore that brings a sandbox back
on a full host, a pids limit past the host's. On the old checkpointer the first two ran actions as
uid 0 and the third made a sandbox past --max-sandboxes. The controls show the refusals are the
policy's: an unprivileged user named in the spec runs, as its numbers.
"""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from belayer_rl.services.checkpointer.client import SandboxClient
from belayer_rl.services.checkpointer.sandbox import numeric_user
from belayer_rl.shared.bus import ServiceError
from belayer_rl.shared.protocol import SandboxSpec

from .conftest import Service

NO_USER = "belayer-sandbox:no-user"
TOOR = "belayer-sandbox:toor"
# The test image with a second name for uid 0, which it then runs as.
TOOR_DOCKERFILE = """FROM {image}
USER 0
RUN echo 'toor:x:0:0:toor:/tmp:/bin/sh' >> /etc/passwd && chmod 666 /etc/passwd
USER toor
"""


def build_images(image: str) -> None:
    """NO_USER: the test image's files imported again with no USER; TOOR: see TOOR_DOCKERFILE."""
    container = subprocess.run(
        ["docker", "create", image], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        subprocess.run(
            f"docker export {container} | docker import --change 'ENV PATH=/bin' - {NO_USER}",
            shell=True,
            check=True,
            capture_output=True,
        )
    finally:
        subprocess.run(["docker", "rm", "-f", container], check=True, capture_output=True)
    subprocess.run(
        ["docker", "build", "--network", "none", "-q", "-t", TOOR, "-"],
        input=TOOR_DOCKERFILE.format(image=image).encode(),
        check=True,
        capture_output=True,
    )


async def refused(call: object) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        await call  # type: ignore[misc]
    return caught.value


async def test_no_image_or_name_runs_actions_as_root_on_a_host_that_forbids_it(
    client: SandboxClient, service: Service, image: str
) -> None:
    await asyncio.to_thread(build_images, image)
    service.stop()
    service.allow_root_user = False
    service.start("--sandbox-pids", "1024")
    await service.ready(client)

    no_user = await refused(client.create(SandboxSpec(image=NO_USER), sandbox="no-user"))
    toor = await refused(client.create(SandboxSpec(image=TOOR), sandbox="toor"))
    named = await refused(client.create(SandboxSpec(image=image, user="toor"), sandbox="named"))
    pids = await refused(client.create(SandboxSpec(image=image, pids_limit=2048), sandbox="pids"))
    assert (no_user.code, toor.code, pids.code) == ("not-allowed",) * 3, (no_user, toor, pids)
    assert "uid 0" in no_user.message and "uid 0" in toor.message and "pids_limit" in pids.message
    assert named.code == "not-allowed" and "passwd" in named.message  # no such user in that image
    assert (await client.list()).sandboxes == [], "a refused sandbox left a container behind"

    # Controls: the same images with an unprivileged user named in the spec run, as its numbers.
    await client.create(SandboxSpec(image=NO_USER, user="65534"), sandbox="nobody")
    await client.create(SandboxSpec(image=TOOR, user="nobody"), sandbox="toor-nobody")
    assert (await client.exec("nobody", "id -u")).stdout == "65534\n"
    # The image lets anyone rewrite /etc/passwd: an action maps nobody to 0, and the next action
    # still runs as 65534, the numbers pinned when the sandbox was made.
    await client.exec("toor-nobody", "sed -i 's/^nobody:x:65534:/nobody:x:0:/' /etc/passwd")
    assert (await client.exec("toor-nobody", "id -u")).stdout == "65534\n"


async def test_a_restore_counts_toward_max_sandboxes(
    client: SandboxClient, service: Service, image: str
) -> None:
    service.stop()
    service.start("--max-sandboxes", "1")
    await service.ready(client)
    await client.create(SandboxSpec(image=image), sandbox="a")
    await client.exec("a", "echo one > /tmp/f")
    await client.checkpoint("a", "t", 1, context_tokens=[1, 2, 3])
    await client.destroy("a")
    await client.create(SandboxSpec(image=image), sandbox="b")  # the host's one sandbox
    full = await refused(client.restore("t", timeout_s=60))
    assert full.code == "host-full", full
    assert [s.sandbox for s in (await client.list()).sandboxes if s.state != "destroyed"] == ["b"]
    await client.destroy("b")  # control: with room again, the same restore runs
    restored = await client.restore("t", timeout_s=60)
    assert (await client.exec(restored.sandbox, "cat /tmp/f")).stdout == "one\n"


def test_numeric_user() -> None:
    passwd = b"root:x:0:0::/:/bin/sh\ntoor:x:0:0::/:/bin/sh\nagent:x:1000:1001::/:/bin/sh\nbad:x:zz:0\n"
    group = b"root:x:0:\nstaff:x:50:\n"
    assert numeric_user("agent", passwd, group) == "1000:1001"  # its group pinned too
    assert numeric_user("1000", passwd, group) == "1000:1001"
    assert numeric_user("4242", passwd, group) == "4242"  # no entry: the daemon's own default
    assert numeric_user("toor", passwd, group) == "0:0"
    assert numeric_user("agent:staff", passwd, group) == "1000:50"
    assert numeric_user("007:0050", None, None) == "7:50"
    for missing in ("bad", "nobody", "agent:wheel"):
        with pytest.raises(ValueError, match="not in the image"):
            numeric_user(missing, passwd, group)
