"""Two removals of one container at once, on a real Docker engine: the daemon answers the second
409 "removal ... is already in progress"; the engine's `remove` waits for the container to be gone
instead of failing (a sandbox made again by name while its last container is removed once failed
its create with that error). The mutation check: a bare DELETE, as `remove` made before, does get
the 409 in the same race."""

from __future__ import annotations

import asyncio
import contextlib

import aiodocker
import pytest

from belayer_rl.services.checkpointer.image import DEFAULT_IMAGE
from belayer_rl.services.checkpointer.sandbox import REMOVAL_UNDER_WAY, DockerEngine
from tests.agent.conftest import sandbox_image

pytestmark = pytest.mark.timeout(120)


async def started(docker: aiodocker.Docker, name: str) -> str:
    container = await docker.containers.create_or_replace(
        name,
        {
            "Image": DEFAULT_IMAGE,
            "Cmd": ["/bin/sh", "-c", "sleep 3600"],
            "HostConfig": {"NetworkMode": "none"},
        },
    )
    await container.start()
    return container.id


async def bare_delete(docker: aiodocker.Docker, container_id: str) -> None:
    async with docker._query(f"containers/{container_id}", method="DELETE", params={"force": "1", "v": "1"}):
        pass


async def test_a_second_removal_waits_for_the_first(tmp_path: object) -> None:
    await sandbox_image("the removal race test")
    engine = await DockerEngine.connect(None, call_timeout_s=30.0, dump_stall_s=30.0)
    docker = engine.docker
    try:
        # The mutation: the bare call loses the race at least once in a few tries.
        refused = []
        for attempt in range(5):
            cid = await started(docker, f"belayer-test-race-bare-{attempt}")
            outcomes = await asyncio.gather(
                bare_delete(docker, cid), bare_delete(docker, cid), return_exceptions=True
            )
            refused += [o for o in outcomes if isinstance(o, aiodocker.DockerError) and o.status == 409]
        assert refused and all(REMOVAL_UNDER_WAY in str(o) for o in refused), refused

        waits = 0
        wait_for_removal = engine.gone

        async def counted(container_id: str) -> None:
            nonlocal waits
            waits += 1
            await wait_for_removal(container_id)

        engine.gone = counted  # type: ignore[method-assign]
        for attempt in range(5):
            cid = await started(docker, f"belayer-test-race-{attempt}")
            await asyncio.gather(engine.remove(cid), engine.remove(cid))  # neither raises
            with pytest.raises(aiodocker.DockerError) as gone:
                await docker._query_json(f"containers/{cid}/json")
            assert gone.value.status == 404
        assert waits >= 1  # the race was run into, and waited out
    finally:
        for attempt in range(5):
            for name in (f"belayer-test-race-bare-{attempt}", f"belayer-test-race-{attempt}"):
                with contextlib.suppress(aiodocker.DockerError):
                    await bare_delete(docker, name)
        await docker.close()
