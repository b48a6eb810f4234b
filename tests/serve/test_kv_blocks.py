"""BlockPool alone: allocation, reference counts, the prefix cache's hash chain, LRU eviction, the leak check."""

from __future__ import annotations

import pytest

from serve.kv_blocks import BlockPool, blocks_for, hash_block


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
    assert pool.match(toks, []) == blocks[:2]
    assert pool.queries == 6 and pool.hits == 4
    assert pool.match(toks + [7], []) == blocks  # one more token: all three full blocks
    assert pool.match([1, 2, 3, 9, 5, 6, 7], []) == blocks[:1]  # diverges in block 1
    assert pool.match([9, 2, 3, 4, 5], []) == []
    assert pool.match([1, 2, 3, 4, 5], [], count=False) == blocks[:2] and pool.queries == 6 + 7 + 7 + 5
    # a hit is taken: reference + 1; released, the blocks stay cached
    hit = pool.match(toks, [])
    pool.take(hit)
    assert pool.ref[blocks[0]] == 2
    pool.release(hit)
    pool.release(blocks)
    assert pool.leaks() == [] and pool.num_free == 8 and pool.num_cached == 3
    assert pool.match(toks + [7], [], count=False) == blocks  # free but cached: still found


def test_duplicate_block_is_not_registered_twice():
    pool = BlockPool(8, 2)
    toks = [1, 2, 3, 4]
    a, b = pool.allocate(2), pool.allocate(2)
    pool.register(a, _hashes(pool, toks), 0, 2)
    pool.register(b, _hashes(pool, toks), 0, 2)  # computed the same prefix before a's was cached
    assert pool.num_cached == 2 and pool.match(toks + [5], []) == a
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
    assert new == [bx[1]] and pool.match(x, [], count=False) == bx[:1]  # x's first block survives
    # a cached free block taken again leaves the queue (not evictable while held)
    pool.take(pool.match(y, [], count=False))
    assert list(pool.free) == [bx[0]] and pool.ref[by[0]] == 1 and pool.ref[by[1]] == 1
    assert pool.allocate(2) is None
    assert pool.allocate(1) == [bx[0]] and pool.num_free == 0
    assert pool.match(x, [], count=False) == []  # evicted
    assert pool.match(y, [], count=False) == by
    assert pool.leaks()  # y's blocks and the new ones are still held


def test_prefix_caching_off_registers_and_finds_nothing():
    pool = BlockPool(4, 2, enable_prefix_caching=False)
    toks = [1, 2, 3, 4, 5]
    b = pool.allocate(2)
    pool.register(b, _hashes(pool, toks), 0, 2)
    assert pool.num_cached == 0 and pool.match(toks, []) == [] and pool.queries == 0
    pool.release(b)
    assert pool.leaks() == []


def test_sizes_and_the_budget_in_blocks():
    from memfit.errors import UserError
    from serve.kv_config import kv_bytes_per_token, num_kv_blocks, parse_size

    assert parse_size("2GiB", "--f") == 2 * 2**30 and parse_size("512MiB", "--f") == 512 * 2**20
    assert parse_size("1.5KiB", "--f") == 1536 and parse_size("4096", "--f") == 4096
    for bad in ("2GB", "-1", "abc", "0", "", "1 GiB extra", "1e9"):
        with pytest.raises(UserError, match="--f"):
            parse_size(bad, "--f")
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    assert kv_bytes_per_token(cfg, 4) == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token({"text_config": cfg}, 2) == 2 * 2 * 2 * 16 * 2  # multimodal config.json
    assert kv_bytes_per_token(cfg, 4, "int8") == 2 * 2 * 2 * (16 + 4)  # a byte an element, an fp32 scale a row
    bpb = 1000
    assert num_kv_blocks(64_500, bpb, 16, 4, 256)[0] == 64  # explicit: not capped by --max-batch
    with pytest.raises(UserError, match="needs 16"):
        num_kv_blocks(15_999, bpb, 16, 4, 256)
    with pytest.raises(UserError, match="smaller than one KV block"):
        num_kv_blocks(999, bpb, 16, 4, 256)
    # default: a quarter of what is available, at most --max-batch x --max-seq-len, at least one sequence
    assert num_kv_blocks(None, bpb, 16, 4, 256, available=10**9)[0] == 64
    assert num_kv_blocks(None, bpb, 16, 4, 256, available=100_000)[0] == 25
    assert num_kv_blocks(None, bpb, 16, 4, 256, available=1000)[0] == 16


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"]])
def test_help_renders(argv, capsys):
    from serve.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and "--kv-cache-memory" in capsys.readouterr().out
