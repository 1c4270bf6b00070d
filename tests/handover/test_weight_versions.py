"""Weight versions end to end: a trainer publishes a new version while requests of the old one run;
each request is generated, across a handover, entirely by the version it was accepted with; old
versions are freed once nothing serves them.

Real processes: nats-server, router, weight and KV servers, shadow supervisor, main and shadow.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from belayer_rl.services.weight_server.client import WeightClient
from belayer_rl.shared.client import GenerationError
from belayer_rl.shared.params import init_params, save_params
from belayer_rl.shared.presets import PRESETS
from belayer_rl.shared.protocol import Handover
from tests.handover.test_handover import shadow_ready, shadowed
from tests.rollout.test_worker_faults import make_job, run
from tests.support import EventLog, busy_requests, kill, poll, reference_tokens

NEW_WEIGHTS_SEED = 7


async def test_requests_keep_their_weight_version_across_a_publish_and_a_kill(
    nats_server, tmp_path, seed
) -> None:
    rng = random.Random(seed)
    async with shadowed(nats_server, tmp_path, failure_window_s=0.01) as cluster:
        weights = WeightClient(cluster.client.nc)
        handovers = await EventLog.start(cluster.client, "handover")
        published_events = await EventLog.start(cluster.client, "weights_published")
        pids = await poll(lambda: shadow_ready(cluster, "e0", set()), timeout_s=120)
        first = (await weights.versions()).newest

        old_jobs = [make_job(rng, f"old-{i}", max_tokens=400) for i in range(3)]
        old_running = [asyncio.create_task(run(cluster.client, j, weight_version=first)) for j in old_jobs]
        await poll(lambda: busy_requests(cluster.client, 0, 300))

        path = tmp_path / "trained.pt"
        newer = save_params(init_params(PRESETS["tiny"], NEW_WEIGHTS_SEED), path)
        assert (await weights.publish(path)).version == newer
        await published_events.wait_for(lambda e: True)
        # Named by nobody: the router gives these the newest version it has heard of.
        new_jobs = [make_job(rng, f"new-{i}", max_tokens=400) for i in range(3)]
        new_running = [asyncio.create_task(run(cluster.client, j)) for j in new_jobs]
        await poll(lambda: busy_requests(cluster.client, 0, 300))
        kill(pids["main"])
        event = await handovers.wait_for(lambda e: isinstance(e, Handover) and e.old_pid == pids["main"])

        old_results = await asyncio.gather(*old_running)
        new_results = await asyncio.gather(*new_running)
        with pytest.raises(GenerationError) as unknown:
            await run(
                cluster.client, make_job(rng, "nowhere", max_tokens=8), weight_version="no-such-version"
            )
        after = await run(cluster.client, make_job(rng, "after", max_tokens=16), weight_version=first)

        async def first_freed() -> bool | None:
            listing = await weights.versions()
            return True if [v.version for v in listing.versions] == [newer] else None

        await poll(first_freed, timeout_s=30)  # the worker released it, the shadow followed

        async def serving_newer() -> bool | None:
            status = await cluster.client.status()
            return True if [e.weight_version for e in status.engines] == [newer] else None

        await poll(serving_newer, timeout_s=10)  # what `belayer status` shows

    assert isinstance(event, Handover) and event.path == "shadow"
    expected_old = reference_tokens(old_jobs)
    expected_new = reference_tokens(new_jobs, weights_seed=NEW_WEIGHTS_SEED)
    assert [r.tokens for r in old_results] == [expected_old[j.request_id] for j in old_jobs]
    assert [r.tokens for r in new_results] == [expected_new[j.request_id] for j in new_jobs]
    assert expected_new != reference_tokens(new_jobs)  # the versions really differ
    assert {r.weight_version for r in old_results} == {first}
    assert {r.weight_version for r in new_results} == {newer}
    assert unknown.value.error.code == "unknown-weight-version"
    assert after.finish_reason in ("length", "eos", "stop")
