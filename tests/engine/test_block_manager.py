import pytest

from belayer_rl.services.worker.block_manager import BlockManager


def test_allocate_and_free_round_trip():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.allocate("a", 9)  # 9 tokens -> 3 blocks
    b = bm.allocate("b", 4)
    assert len(a) == 3
    assert len(b) == 1
    assert not set(a) & set(b)
    assert bm.num_free == 4
    assert bm.block_table("a") == a
    bm.free("a")
    assert bm.num_free == 7
    assert "a" not in bm
    assert "b" in bm


def test_can_allocate_and_blocks_needed():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert bm.blocks_needed(0) == 0
    assert bm.blocks_needed(1) == 1
    assert bm.blocks_needed(16) == 1
    assert bm.blocks_needed(17) == 2
    assert bm.can_allocate(64)
    assert not bm.can_allocate(65)
    assert bm.fits_at_all(64)
    assert not bm.fits_at_all(65)
    bm.allocate("x", 40)  # 3 blocks
    assert bm.can_allocate(16)
    assert not bm.can_allocate(17)
    assert bm.fits_at_all(64)


def test_exhaustion_raises_and_keeps_state():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate("a", 5)
    with pytest.raises(MemoryError):
        bm.allocate("b", 1)
    assert bm.num_free == 0
    assert "b" not in bm


def test_double_allocate_and_double_free_fail_loudly():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 1)
    with pytest.raises(ValueError):
        bm.allocate("a", 1)
    bm.free("a")
    with pytest.raises(KeyError):
        bm.free("a")
    assert bm.num_free == 4


def test_freed_blocks_are_reused_and_never_shared():
    bm = BlockManager(num_blocks=6, block_size=2)
    held: dict[int, list[int]] = {}
    for i in range(50):
        if bm.can_allocate(3):
            held[i] = bm.allocate(i, 3)
        else:
            oldest = min(held)
            bm.free(oldest)
            del held[oldest]
        in_use = [blk for table in held.values() for blk in table]
        assert len(in_use) == len(set(in_use))
        assert len(in_use) + bm.num_free == 6


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0, "block_size": 4}, {"num_blocks": 4, "block_size": 0}])
def test_rejects_non_positive_sizes(kwargs):
    with pytest.raises(ValueError):
        BlockManager(**kwargs)
