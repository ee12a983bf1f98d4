"""The KV block pool and block tables: plain Python accounting, no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tailguard.engine.blocks import BlockPool, BlockTable, OutOfBlocksError


def test_blocks_and_scheduler_do_not_import_torch():
    code = (
        "import sys\n"
        "import tailguard.engine.blocks, tailguard.engine.scheduler, tailguard.engine.sequence\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "blocks/scheduler/request must stay importable without torch"


def test_pool_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockPool(0, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


def test_blocks_for_rounds_up():
    pool = BlockPool(8, block_size=16)
    assert [pool.blocks_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocate_free_accounting_and_owners():
    pool = BlockPool(6, block_size=4)
    a = pool.allocate(2, "a")
    b = pool.allocate(3, "b")
    assert len(set(a) | set(b)) == 5, "blocks handed out twice"
    assert pool.num_used == 5 and pool.num_free == 1
    assert pool.owners() == {"a", "b"}
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2, "c")
    assert pool.num_used == 5, "a failed allocation must not take blocks"
    pool.free(a)
    assert pool.owners() == {"b"} and pool.num_free == 3
    pool.free(b)
    assert pool.num_used == 0 and pool.owners() == set()


def test_double_free_and_foreign_free_raise():
    pool = BlockPool(4, block_size=4)
    blocks = pool.allocate(2, "a")
    pool.free(blocks)
    with pytest.raises(ValueError):
        pool.free(blocks)
    with pytest.raises(ValueError):
        pool.free([3])  # never allocated
    assert pool.num_free == 4


def test_block_table_grows_on_demand_and_maps_slots():
    pool = BlockPool(8, block_size=4)
    table = BlockTable(pool, "r")
    assert table.ensure(1) and len(table.blocks) == 1
    assert table.ensure(4) and len(table.blocks) == 1, "4 tokens fit in one block of 4"
    assert table.blocks_needed(9) == 2
    assert table.ensure(9) and len(table.blocks) == 3
    assert table.capacity == 12
    # Every position maps into its own block, and no two positions share a slot.
    slots = [table.slot(p) for p in range(12)]
    assert len(set(slots)) == 12
    for p, s in enumerate(slots):
        assert s // 4 == table.blocks[p // 4] and s % 4 == p % 4
    table.release()
    assert table.blocks == [] and pool.num_used == 0
    table.release()  # releasing an empty table is a no-op


def test_block_table_ensure_is_all_or_nothing():
    pool = BlockPool(3, block_size=4)
    other = BlockTable(pool, "other")
    assert other.ensure(8)  # 2 blocks
    table = BlockTable(pool, "r")
    assert not table.ensure(12), "3 blocks needed, 1 free"
    assert table.blocks == [] and pool.num_free == 1, "a failed ensure must allocate nothing"
    assert table.ensure(4)
    assert pool.owners() == {"other", "r"}
