"""BlockPool alone: allocation, reference counts, the prefix cache's hash chain, LRU eviction, the leak check."""

from __future__ import annotations

import pytest

from memfit.runtime.kv_groups import blocks_for
from serve.kv_blocks import BlockPool, hash_block


def _hashes(pool: BlockPool, tokens: list[int]) -> list[bytes]:
    return pool.extend_hashes(tokens, [], len(tokens) // pool.block_size)


def test_allocate_release_and_refcounts():
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1 and pool.num_used == 3
    assert pool.allocate(2) is None and pool.num_free == 1  # all or nothing
    pool.take([1])  # a second holder
    pool.release(a)
    assert pool.ref == [0, 1, 0, 0] and pool.num_free == 3
    assert pool.leaks() and "1 block(s) still referenced" in pool.leaks()[0]
    pool.release([1])
    assert pool.leaks() == []
    with pytest.raises(RuntimeError):
        pool.release([1])
    assert blocks_for(0, 4) == 0 and blocks_for(1, 4) == 1 and blocks_for(4, 4) == 1 and blocks_for(5, 4) == 2


def test_allocation_hands_out_the_evicted_blocks_in_ascending_order():
    # a release queues a sequence's blocks last-first; the next allocation takes the same blocks (LRU), sorted,
    # so the kernels read them as one run of memory
    pool = BlockPool(8, 2)
    a, b = pool.allocate(4), pool.allocate(4)
    pool.release(b)
    pool.release(a)
    assert list(pool.free) == [7, 6, 5, 4, 3, 2, 1, 0]
    assert pool.allocate(3) == [5, 6, 7] and pool.allocate(5) == [0, 1, 2, 3, 4]


def test_hash_chain_names_the_whole_prefix():
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    # the same block tokens after different prefixes hash differently
    assert hash_block(hash_block(None, [1, 2]), [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    pool = BlockPool(8, 2)
    h = []
    pool.extend_hashes([1, 2, 3, 4, 5], h, 1)
    first = h[0]
    pool.extend_hashes([1, 2, 3, 4, 5], h, 2)  # grows, does not rehash
    assert h[0] is first and len(h) == 2 and h[1] == hash_block(first, [3, 4])


def test_match_reuses_the_longest_cached_chain_but_never_the_last_token():
    pool = BlockPool(8, 2)
    toks = [1, 2, 3, 4, 5, 6]
    blocks = pool.allocate(3)
    pool.register(blocks, _hashes(pool, toks), 0, 3)
    assert pool.num_cached == 3
    # identical tokens: at most (6 - 1) // 2 = 2 blocks, the last token is computed again
    assert pool.match(toks, []) == [blocks[:2]]
    assert pool.queries == 6 and pool.hits == 4
    assert pool.match(toks + [7], []) == [blocks]  # one more token: all three full blocks
    assert pool.match([1, 2, 3, 9, 5, 6, 7], []) == [blocks[:1]]  # diverges in block 1
    assert pool.match([9, 2, 3, 4, 5], []) == [[]]
    assert pool.match([1, 2, 3, 4, 5], [], count=False) == [blocks[:2]] and pool.queries == 6 + 7 + 7 + 5
    # a hit is taken: reference + 1; released, the blocks stay cached
    hit = pool.match(toks, [])[0]
    pool.take(hit)
    assert pool.ref[blocks[0]] == 2
    pool.release(hit)
    pool.release(blocks)
    assert pool.leaks() == [] and pool.num_free == 8 and pool.num_cached == 3
    assert pool.match(toks + [7], [], count=False) == [blocks]  # free but cached: still found


def test_duplicate_block_is_not_registered_twice():
    pool = BlockPool(8, 2)
    toks = [1, 2, 3, 4]
    a, b = pool.allocate(2), pool.allocate(2)
    pool.register(a, _hashes(pool, toks), 0, 2)
    pool.register(b, _hashes(pool, toks), 0, 2)  # computed the same prefix before a's was cached
    assert pool.num_cached == 2 and pool.match(toks + [5], []) == [a]
    assert pool.hash_of[b[0]] is None


def test_unreferenced_cached_blocks_are_evicted_lru_tail_blocks_first():
    pool = BlockPool(4, 2)
    x, y = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    bx, by = pool.allocate(2), pool.allocate(2)
    pool.register(bx, _hashes(pool, x), 0, 2)
    pool.register(by, _hashes(pool, y), 0, 2)
    pool.release(bx)  # x freed first: its blocks are the first evicted, its tail block before its head
    pool.release(by)
    assert list(pool.free) == [bx[1], bx[0], by[1], by[0]]
    new = pool.allocate(1)
    assert new == [bx[1]] and pool.match(x, [], count=False) == [bx[:1]]  # x's first block survives
    # a cached free block taken again leaves the queue (not evictable while held)
    pool.take(pool.match(y, [], count=False)[0])
    assert list(pool.free) == [bx[0]] and pool.ref[by[0]] == 1 and pool.ref[by[1]] == 1
    assert pool.allocate(2) is None
    assert pool.allocate(1) == [bx[0]] and pool.num_free == 0
    assert pool.match(x, [], count=False) == [[]]  # evicted
    assert pool.match(y, [], count=False) == [by]
    assert pool.leaks()  # y's blocks and the new ones are still held


def test_prefix_caching_off_registers_and_finds_nothing():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    toks = [1, 2, 3, 4, 5]
    b = pool.allocate(2)
    pool.register(b, _hashes(pool, toks), 0, 2)
    assert pool.num_cached == 0 and pool.match(toks, []) == [[]] and pool.queries == 0
    pool.release(b)
    assert pool.leaks() == []


def test_sizes_and_the_budget_in_blocks():
    from memfit.errors import UserError
    from memfit.runtime.kv_groups import group_layers
    from serve.kv_config import KVLayout, kv_bytes_per_token, num_kv_blocks, parse_size

    assert parse_size("2GiB", "--f") == 2 * 2**30 and parse_size("512MiB", "--f") == 512 * 2**20
    assert parse_size("1.5KiB", "--f") == 1536 and parse_size("4096", "--f") == 4096
    for bad in ("2GB", "-1", "abc", "0", "", "1 GiB extra", "1e9"):
        with pytest.raises(UserError, match="--f"):
            parse_size(bad, "--f")
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    assert kv_bytes_per_token(cfg, 4) == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token({"text_config": cfg}, 2) == 2 * 2 * 2 * 16 * 2  # multimodal config.json
    assert kv_bytes_per_token({"n_layer": 2, "n_head": 4, "n_embd": 64}, 4) == 2 * 2 * 4 * 16 * 4  # GPT-2's names
    assert kv_bytes_per_token(cfg, 4, "int8") == 2 * 2 * 2 * (16 + 4)  # a byte an element, an fp32 scale a row
    lay = KVLayout(group_layers([None, None]), 16, 1000)
    assert num_kv_blocks(64_500, lay, 4, 256, 256)[0] == 64  # explicit: not capped by --max-batch
    with pytest.raises(UserError, match="needs 16"):
        num_kv_blocks(15_999, lay, 4, 256, 256)
    with pytest.raises(UserError, match="smaller than one KV block"):
        num_kv_blocks(999, lay, 4, 256, 256)
    # default: a quarter of what is available, at most --max-batch x --max-seq-len, at least one sequence
    assert num_kv_blocks(None, lay, 4, 256, 256, available=10**9)[0] == 64
    assert num_kv_blocks(None, lay, 4, 256, 256, available=100_000)[0] == 25
    assert num_kv_blocks(None, lay, 4, 256, 256, available=1000)[0] == 16


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"]])
def test_help_renders(argv, capsys):
    from serve.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and "--kv-cache-memory" in capsys.readouterr().out


def _grow(pool: BlockPool, rows: list[list[int]], n: int) -> None:
    """Every group takes ``n`` more blocks (as the scheduler grows a sequence)."""
    new = pool.allocate(n * len(rows))
    for g, row in enumerate(rows):
        row.extend(new[g * n:(g + 1) * n])


def test_sliding_groups_drop_the_blocks_behind_their_window():
    from memfit.runtime.kv_groups import NULL_BLOCK

    pool = BlockPool(32, 4, windows=(8, None))  # a sliding group (window 8) and a full one
    rows: list[list[int]] = [[], []]
    _grow(pool, rows, 5)  # positions 0..19
    pool.drop_behind(rows, 12)  # the query at 12 sees keys 5..12: block 0 (positions 0-3) is dead
    assert rows[0][0] == NULL_BLOCK and NULL_BLOCK not in rows[0][1:] and NULL_BLOCK not in rows[1]
    assert pool.num_used == 9
    pool.drop_behind(rows, 20)  # keys 13..20: blocks 0-2 dead
    assert rows[0][:3] == [NULL_BLOCK] * 3 and pool.num_used == 7
    pool.drop_behind(rows, 20)  # idempotent
    assert pool.num_used == 7
    for row in rows:
        pool.release(row)  # NULL entries are skipped
    assert pool.leaks() == [] and pool.num_free == 32


def test_a_sliding_hit_needs_only_the_blocks_inside_the_window():
    from memfit.runtime.kv_groups import NULL_BLOCK

    pool = BlockPool(64, 4, windows=(8, None))
    toks = list(range(1, 30))  # 29 tokens: 7 full blocks
    rows: list[list[int]] = [[], []]
    _grow(pool, rows, 8)
    hashes = _hashes(pool, toks)
    for g, row in enumerate(rows):
        pool.register(row, hashes, 0, 7, g)
    rows = [list(r) for r in rows]  # the ids, before the sliding group's entries behind the window go NULL
    pool.drop_behind([list(r) for r in rows], 29)
    for row in rows:
        pool.release([b for b in row if pool.ref[b]])
    # a new sequence of the same 29 tokens + 3: a hit of 7 blocks (28 tokens); the next query (28) sees keys
    # 21..28, so the sliding group needs blocks 5 and 6 only
    hit = pool.match(toks + [40, 41, 42], [], count=False)
    assert hit[1] == rows[1][:7] and hit[0] == [NULL_BLOCK] * 5 + rows[0][5:7]
    # evict the sliding group's block 6 (first in the LRU queue): the hit shrinks to 6 blocks, whose window
    # (keys 17..24: blocks 4 and 5) is whole; the sliding group's block 4 was dropped but is still cached
    pool.free.move_to_end(rows[0][6], last=False)
    assert pool.allocate(1) == [rows[0][6]]
    hit = pool.match(toks + [40, 41, 42], [], count=False)
    assert hit[1] == rows[1][:6] and hit[0] == [NULL_BLOCK] * 4 + rows[0][4:6]
    # with block 4 evicted as well, no shorter window is whole before block 3's: 4 blocks (keys 9..16)
    pool.free.move_to_end(rows[0][4], last=False)
    assert pool.allocate(1) == [rows[0][4]]
    hit = pool.match(toks + [40, 41, 42], [], count=False)
    assert hit[1] == rows[1][:4] and hit[0] == [NULL_BLOCK] * 2 + rows[0][2:4]


def test_sliding_layers_size_blocks_by_group_and_sequences_by_window():
    """Gemma 3 270M's config: 6 KV groups of 3 layers, a block 3 layers deep; the smallest budget and serve plan's
    count of sequences use what a sequence holds with its sliding groups' blocks dropped."""
    import argparse

    from memfit.errors import UserError
    from serve.kv_config import kv_bytes_per_token, kv_layout, num_kv_blocks
    from serve.plan import kv_prediction

    cfg = {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
           "hidden_size": 640, "sliding_window": 512,
           "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3}
    lay = kv_layout(cfg, 4, "auto", 16, 2048)
    assert len(lay.groups) == 6 and lay.bytes_per_block == 2 * 256 * 4 * 3 * 16
    assert lay.bytes_per_block * 6 == kv_bytes_per_token(cfg, 4) * 16  # one block in every group: all layers
    assert lay.seq_blocks(2048, 256) == 128 + 5 * 49 and lay.seq_blocks(2048, 1) == 128 + 5 * 33
    assert kv_layout(cfg, 4, "auto", 16, 512).groups.size == 18  # max_seq_len 512: the window never limits
    per_seq = lay.seq_blocks(2048, 256)
    assert num_kv_blocks(per_seq * lay.bytes_per_block, lay, 4, 2048, 256)[0] == per_seq
    with pytest.raises(UserError, match=f"needs {per_seq}"):
        num_kv_blocks(per_seq * lay.bytes_per_block - 1, lay, 4, 2048, 256)
    args = argparse.Namespace(block_size=16, dtype="fp32", cpu_kernels="on", kv_cache_dtype="auto", max_batch=16,
                              seq_len=2048, prefill_chunk=1)
    kv = kv_prediction(cfg, args, 64 * 2**20, 2048, 0)
    assert kv["blocks"] == 64 * 2**20 // lay.bytes_per_block and kv["kv_groups"] == 6 and kv["layers_per_group"] == 3
    assert kv["sequences_fit"] == kv["blocks"] // (128 + 5 * 33) == 2  # 0.38x of whole sequences: 2, not 0
    assert kv["static_slots_same_bytes"] == 0  # a 2048-position slot in every layer takes 72 MiB
