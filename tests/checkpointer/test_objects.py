"""Downloads from the checkpoint object store are bounded: an object larger than the host accepts
is refused before and while it is fetched, and a link into another bucket is not followed. Real
nats-server with JetStream; no Docker needed."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from nats.js.api import ObjectLink, ObjectMeta, ObjectMetaOptions

from belayer_rl.services.checkpointer import layer, objects
from belayer_rl.services.checkpointer.store import TMP_PREFIX, CorruptCheckpoint, Store
from belayer_rl.shared import bus

from .helpers import NAMES

CHECKPOINT = "i0-k1-00aa11bb"


@pytest.fixture
async def object_store(nats_url: str):  # type: ignore[no-untyped-def]
    nc = await bus.connect(nats_url, "test-objects")
    try:
        yield await objects.declare(nc.jetstream(), NAMES)
    finally:
        await nc.close()


async def test_an_object_over_the_bound_is_refused_and_leaves_nothing(object_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = Store(tmp_path / "store", b"k" * 32)
    await object_store.put(objects.object_name("traj", CHECKPOINT), io.BytesIO(b"x" * 300_000))
    with pytest.raises(objects.TooBig, match="300000 bytes"):
        await objects.download(object_store, store, "traj", CHECKPOINT, max_bytes=100_000)
    folder = store.trajectory_dir("traj")
    assert not folder.exists() or not [p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]
    # Under the bound it is fetched, and then refused for what it is (not a checkpoint archive):
    # the bound alone decided above. Mutation check: without it the first call fails the same way.
    with pytest.raises(layer.HostileLayer, match="not a readable tar"):
        await objects.download(object_store, store, "traj", CHECKPOINT, max_bytes=400_000)


def test_the_bounded_writer_stops_at_the_limit_whatever_the_metadata_says(tmp_path: Path) -> None:
    """The object's size is metadata a writer of the bucket controls; the bytes are counted too."""
    with (tmp_path / "out").open("wb") as f:
        bounded = objects._Bounded(f, 10, "obj")
        bounded.write(b"12345")
        bounded.write(b"67890")
        with pytest.raises(objects.TooBig):
            bounded.write(b"1")
    assert (tmp_path / "out").read_bytes() == b"1234567890"


async def test_a_link_is_not_followed(object_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = Store(tmp_path / "store", b"k" * 32)
    await object_store.put("elsewhere", io.BytesIO(b"y" * 1000))
    name = objects.object_name("traj", CHECKPOINT)
    link = ObjectMeta(
        name=name,
        options=ObjectMetaOptions(
            link=ObjectLink(bucket=object_store._name, name="elsewhere"), max_chunk_size=128 * 1024
        ),
    )
    await object_store.put(
        name, b"-", meta=link
    )  # what a link is on the wire: metadata naming another object
    with pytest.raises(CorruptCheckpoint, match="link"):
        await objects.download(object_store, store, "traj", CHECKPOINT, max_bytes=1 << 20)
