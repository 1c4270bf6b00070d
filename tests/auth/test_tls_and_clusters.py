"""An external NATS: TLS with certificates the test makes, and two Belayer clusters on one server.

Both run nats-server with authorization (the users of `belayer creds`), so every service connects
with its own credential; under TLS each also verifies the server against the test's CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
import trustme

from belayer_rl.cli.cluster import ClusterConfig, Supervisor, local_cluster
from belayer_rl.services import SERVICES as DECLARATIONS
from belayer_rl.shared import bus, protocol
from belayer_rl.shared.access import Access
from belayer_rl.shared.client import Client
from belayer_rl.shared.processes import free_port, start_nats_server, stop_process
from belayer_rl.shared.protocol import ServiceStats, StatsRequest
from belayer_rl.shared.roles import Credentials, authorization
from belayer_rl.shared.subjects import Subjects
from tests.support import Job, poll, reference_tokens

SERVICES = ("router", "weight-server", "kv-server", "shadow-supervisor")


@contextlib.asynccontextmanager
async def nats_with(folder: Path, settings: str) -> AsyncIterator[int]:
    """nats-server with JetStream and the given config text; yields its port."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "nats.conf"
    config.write_text(settings)
    port = free_port()
    process = await start_nats_server(folder / "jetstream", port, folder / "nats.log", config)
    try:
        yield port
    finally:
        await stop_process(process)


def write_credentials(folder: Path, cluster_id: str, engines: tuple[str, ...]) -> Credentials:
    creds = Credentials.generate(DECLARATIONS, Subjects(cluster_id), engines)
    creds.write(folder)
    return creds


async def stats_of(client: Client, name: str) -> ServiceStats:
    return await bus.request_struct(
        client.nc, client.subjects.service_stats(name), StatsRequest(), ServiceStats, 5.0
    )


async def test_every_service_connects_over_tls_with_its_credential_and_the_ca(tmp_path: Path) -> None:
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_file, cert_file = tmp_path / "ca.pem", tmp_path / "server.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server_cert.private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    creds = write_credentials(tmp_path / "creds", "default", ("e0",))
    settings = f'tls {{\n  cert_file: "{cert_file}"\n  key_file: "{cert_file}"\n}}\n{creds.authorization()}'

    async with nats_with(tmp_path / "nats", settings) as port:
        url = f"tls://127.0.0.1:{port}"
        # Without the CA the server's certificate is not trusted: no connection.
        with pytest.raises((ssl.SSLError, nats.errors.Error, OSError)):
            await nats.connect(
                url, allow_reconnect=False, **Access(creds=tmp_path / "creds" / "cli.creds").connect_options()
            )

        config = ClusterConfig(
            state_dir=tmp_path / "state",
            nats_url=url,
            creds_dir=tmp_path / "creds",
            nats_ca=ca_file,
            engines=1,
            shadows=True,
            sandboxes=False,
        )
        async with local_cluster(config) as supervisor:
            async with await Client.connect(supervisor.target("cli"), "test-cli") as client:
                await client.wait_for_engines(1, 120)
                job = Job("over-tls", "a private line", max_tokens=24, seed=11)
                result = await client.generate_all(
                    job.prompt, max_tokens=job.max_tokens, seed=job.seed, temperature=0.8
                )
            async with await Client.connect(supervisor.target("admin"), "test-admin") as admin:
                for name in SERVICES:  # the shadow supervisor is ready once its shadow stands by

                    async def ready(name: str = name) -> bool | None:
                        return (await stats_of(admin, name)).ready or None

                    await poll(ready, timeout_s=120, every_s=0.2)
        assert result.tokens == (await asyncio.to_thread(reference_tokens, [job]))[job.request_id]
        log = (tmp_path / "nats" / "nats.log").read_text()
        assert "Authorization Violation" not in log and "Permissions Violation" not in log


@contextlib.asynccontextmanager
async def cluster_on(url: str, tmp_path: Path, cluster_id: str) -> AsyncIterator[Supervisor]:
    config = ClusterConfig(
        state_dir=tmp_path / cluster_id,
        nats_url=url,
        cluster_id=cluster_id,
        creds_dir=tmp_path / f"creds-{cluster_id}",
        engines=1,
        shadows=False,
        sandboxes=False,
    )
    async with local_cluster(config) as supervisor:
        yield supervisor


async def test_two_clusters_on_one_server_never_see_each_other(tmp_path: Path) -> None:
    alpha = write_credentials(tmp_path / "creds-alpha", "alpha", ("e0",))
    beta = write_credentials(tmp_path / "creds-beta", "beta", ("e0",))  # the same engine id in both
    async with nats_with(tmp_path / "nats", authorization(alpha, beta)) as port:
        url = f"nats://127.0.0.1:{port}"
        async with cluster_on(url, tmp_path, "alpha") as a, cluster_on(url, tmp_path, "beta") as b:
            seen: dict[str, list[str]] = {"alpha": [], "beta": []}
            clients = {}
            for name, supervisor in (("alpha", a), ("beta", b)):
                client = await Client.connect(supervisor.target("cli"), f"test-{name}")
                clients[name] = client
                await client.wait_for_engines(1, 120)

                async def on_event(msg: nats.aio.msg.Msg, name: str = name) -> None:
                    seen[name].append(msg.data.decode())

                await client.nc.subscribe(client.subjects.events_all, cb=on_event)
            try:
                jobs = {
                    "alpha": Job("a", "one cluster", max_tokens=20, seed=1),
                    "beta": Job("b", "another", max_tokens=20, seed=2),
                }
                results = await asyncio.gather(
                    *(
                        clients[name].generate_all(
                            job.prompt, max_tokens=job.max_tokens, seed=job.seed, temperature=0.8
                        )
                        for name, job in jobs.items()
                    )
                )
                expected = await asyncio.to_thread(reference_tokens, list(jobs.values()))
                for (name, job), result in zip(jobs.items(), results, strict=True):
                    assert result.tokens == expected[job.request_id], name
                ids = {name: r.request_id for name, r in zip(jobs, results, strict=True)}

                # Each router knows its own request only; each cluster's events come from its own
                # processes only: the heartbeats of its worker, never of the other's (same engine id).
                worker_pid = {
                    name: sup.children["worker-e0"].pid for name, sup in (("alpha", a), ("beta", b))
                }
                for name, other in (("alpha", "beta"), ("beta", "alpha")):
                    status = await clients[name].status()
                    assert ids[other] not in {r.request_id for r in status.requests}

                    async def own_beats(name: str = name) -> list[str] | None:
                        """The heartbeats seen so far, once its own worker's are among them (the
                        control: every 0.2 s, so a fast run may not have seen one yet)."""
                        beats = [event for event in seen[name] if '"type":"heartbeat"' in event]
                        return beats if any(f'"pid":{worker_pid[name]},' in b for b in beats) else None

                    beats = await poll(own_beats, timeout_s=10, every_s=0.1)
                    assert not any(f'"pid":{worker_pid[other]},' in beat for beat in beats), (
                        f"{name} saw {other}'s"
                    )

                # One cluster's user cannot even listen to the other's events.
                errors: list[str] = []

                async def on_error(exc: Exception) -> None:
                    errors.append(str(exc).lower())

                spy = await nats.connect(url, error_cb=on_error, **a.access("cli").connect_options())
                try:
                    await spy.subscribe(Subjects("beta").events_all)
                    await spy.flush()
                    await asyncio.sleep(0.5)
                finally:
                    await spy.close()
                assert any("permissions violation" in e and "belayer.beta.evt" in e for e in errors), errors

                # Separate token logs: alpha's stream holds no record of beta's request.
                names = Subjects("alpha")
                admin = await a.target("admin").connect("test-admin")
                try:
                    js = admin.jetstream()
                    with pytest.raises(nats.js.errors.NotFoundError):
                        await js.get_last_msg(names.token_log_stream, names.token_log(ids["beta"]))
                    record = await js.get_last_msg(names.token_log_stream, names.token_log(ids["alpha"]))
                    end = protocol.decode(protocol.decoder_for(protocol.LogRecord), record.data)
                    assert isinstance(end, protocol.LogEnd)
                finally:
                    await admin.close()
            finally:
                for client in clients.values():
                    await client.nc.close()
