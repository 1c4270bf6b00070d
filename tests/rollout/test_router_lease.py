"""The router lease's incarnation against a real nats-server: it only ever grows."""

from __future__ import annotations

import asyncio

from belayer_rl.services.router.lease import KEY, Lease, lease_bucket
from belayer_rl.shared import bus
from belayer_rl.shared.subjects import Subjects

TTL_S = 0.3


async def test_a_deleted_or_purged_lease_never_hands_out_a_lower_incarnation(nats_server) -> None:
    """Workers refuse a dispatch from an incarnation below the highest they have seen, so a router
    that counted again from 1 after an operator deleted the lease key could never dispatch.
    Mutation check, run by hand: taking a missing key as incarnation 1 (the earlier code) hands
    out 1 after the delete."""
    nc = await bus.connect(nats_server.url, "test-lease")
    try:
        kv = await lease_bucket(nc.jetstream(), Subjects(), 1)
        seen = []
        for _ in range(3):  # each lease left to expire, then taken over by the next router
            lease = Lease(kv, TTL_S)
            await asyncio.wait_for(lease.acquire(), 10 * TTL_S)
            seen.append(lease.incarnation)
        assert seen == sorted(set(seen)), seen
        for remove in (kv.delete, kv.purge):
            await remove(KEY)
            lease = Lease(kv, TTL_S)
            await asyncio.wait_for(lease.acquire(), 10 * TTL_S)
            assert lease.incarnation > max(seen), (remove.__name__, lease.incarnation, seen)
            seen.append(lease.incarnation)
    finally:
        await nc.close()
