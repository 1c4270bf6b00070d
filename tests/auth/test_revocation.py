"""Trust finding 11: one leaked credential is revoked without restarting the cluster or replacing
any other credential. `belayer creds --revoke engine-e0` (the real command, against a running
local cluster with its authorizing nats-server) gives engine-e0 a new key and reloads the server:
a connection made with the old key is closed, a new one is refused, every other credential is
unchanged and still works, the new key connects, and the cluster serves token-exact on."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
import pytest

from belayer_rl.cli.cluster import ClusterConfig, local_cluster
from belayer_rl.shared.access import Access
from belayer_rl.shared.client import Client
from tests.support import Job, poll, reference_tokens

BELAYER = "import sys; from belayer_rl.cli.main import main; main(sys.argv[1:])"  # the `belayer` command


async def test_a_revoked_engine_key_is_refused_and_nothing_else_changes(tmp_path: Path) -> None:
    job = Job("after-revoke", "the cluster serves on", max_tokens=24, seed=6)
    expected = (await asyncio.to_thread(reference_tokens, [job]))[job.request_id]
    state = tmp_path / "state"
    config = ClusterConfig(state_dir=state, engines=2, shadows=False, sandboxes=False)
    async with local_cluster(config) as cluster:
        async with await Client.connect(cluster.target("cli"), "test-cli") as client:
            await client.wait_for_engines(2, 120)
        creds = cluster.creds_dir
        assert creds is not None
        before = {path.name: path.read_text() for path in creds.glob("*.creds")}
        old_key = tmp_path / "leaked.creds"
        old_key.write_text(before["engine-e0.creds"])
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        leaked = await nats.connect(
            cluster.nats_url,
            error_cb=on_error,
            max_reconnect_attempts=1,
            **Access(creds=old_key).connect_options(),
        )
        revoked = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-c",
                BELAYER,
                "creds",
                "--revoke",
                "engine-e0",
                "--state-dir",
                str(state),
            ],
            capture_output=True,
            text=True,
        )
        assert revoked.returncode == 0, revoked.stderr
        await poll(
            lambda: asyncio.sleep(0, True if leaked.is_closed or not leaked.is_connected else None), 10
        )
        assert errors, "the server closed the leaked key's connection without a word"  # its reload did
        with pytest.raises(nats.errors.Error, match=r"(?i)authorization"):
            await nats.connect(
                cluster.nats_url, allow_reconnect=False, **Access(creds=old_key).connect_options()
            )

        after = {path.name: path.read_text() for path in creds.glob("*.creds")}
        changed = sorted(name for name in before if before[name] != after[name])
        assert changed == ["engine-e0.creds"], changed
        fresh = await nats.connect(
            cluster.nats_url, allow_reconnect=False, **cluster.access("engine-e0").connect_options()
        )
        await fresh.close()
        async with await Client.connect(cluster.target("cli"), "test-cli") as client:
            result = await client.generate_all(
                job.prompt, max_tokens=job.max_tokens, seed=job.seed, temperature=0.8
            )
    await leaked.close()
    assert result.tokens == expected
