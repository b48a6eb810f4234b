"""The paged KV cache's block allocator: which physical blocks are free, who holds each one, and which full blocks
hold which tokens (automatic prefix caching).

Modelled on vLLM v1's ``BlockPool`` and ``KVCacheManager`` (vllm/v1/core/), kept small:

- the model's K/V cache is ``num_blocks`` blocks of ``block_size`` positions (in every layer); a sequence holds a
  list of block ids covering its positions in order (its row of ``SlotModel.block_table``);
- every block has a reference count: the sequences whose block list holds it. A block whose count drops to 0 goes
  to the tail of the free queue, which is also the eviction order (LRU): an allocation takes the queue's head
  (handed out in ascending order, so that a sequence's blocks are one run of memory where they can be);
- a *full* block of a sequence (``block_size`` computed tokens) is registered under a chain hash,
  ``H(parent block's hash, its token ids)``, so the hash names the whole prefix up to the block's end. A later
  sequence whose tokens start with the same prefix takes those blocks (reference count + 1) instead of computing
  them again. A registered block keeps its hash while free, and is reusable until an allocation evicts it;
- shared blocks are never written: a sequence reuses at most ``(len(tokens) - 1) // block_size`` blocks, so at
  least its last token is computed (its logits give the next token) and every write lands in a block of its own.

The hash is SHA-256 over the parent's digest and the block's token ids (collision-safe across requests, about a
microsecond a block). Not thread-safe: the scheduler calls it under its lock.

With sliding-window layers the model's layers form KV groups (memfit.runtime.kv_groups), each with a window (None:
full attention): a sequence holds one block list per group, all the same length, and the pool's blocks serve
every group. A sliding group's blocks behind its window go back to the pool as the sequence moves on
(``drop_behind``; their entries become ``NULL_BLOCK``), and are registered per group: a prefix hit needs every
full group's blocks of the prefix but only the blocks inside each sliding group's window at the prefix's end.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from memfit.runtime.kv_groups import NULL_BLOCK, blocks_held, first_live_block

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """The chain hash of one full block: its tokens, and (through ``parent``) every token before them."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens: allocation, reference counts and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,)):
        """``windows``: the model's KV groups' windows (``KVGroups.windows``; one full-attention group by
        default)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.sliding = any(w is not None for w in self.windows)
        self.ref = [0] * num_blocks
        # (group, hash) a block is registered under: a hash names a prefix, each group holds its own blocks of it
        self.hash_of: list[tuple[int, BlockHash] | None] = [None] * num_blocks
        self.cached: dict[tuple[int, BlockHash], int] = {}  # (group, hash) -> block id (the first registered)
        # blocks with ref 0, in eviction order (head first); dict for O(1) removal when a cached one is reused
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.queries = 0  # prefix-cache lookups, in tokens (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found cached (prefix_cache_hits)

    # ---- counts ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: unreferenced, cached or not."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or not)."""
        return len(self.cached)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of ``num_tokens`` positions holds at once (prefill steps of ``chunk``)."""
        return blocks_held(self.windows, num_tokens, self.block_size, chunk)

    # ---- prefix cache ----------------------------------------------------------------------------
    def extend_hashes(self, tokens: list[int], hashes: list[BlockHash], num_full: int) -> list[BlockHash]:
        """Grow ``hashes`` (a sequence's chain hashes, kept on it across steps) to its first ``num_full`` full
        blocks of ``tokens``; returns it. Blocks already hashed are not hashed again."""
        bs = self.block_size
        for i in range(len(hashes), num_full):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def match(self, tokens: list[int], hashes: list[BlockHash], count: bool = True) -> list[list[int]]:
        """Per group, the cached blocks of the longest prefix of ``tokens`` whose blocks every group has: all of
        them in a full group, those inside the window of the prefix's end in a sliding group (``NULL_BLOCK``
        before). Capped at ``(len(tokens) - 1) // block_size`` blocks (the last token is always computed). Takes
        no reference (``take`` does). ``count``: add to the query/hit counters (a sequence's first admission;
        not its resumes)."""
        G = len(self.windows)
        if not self.enable_prefix_caching:
            return [[] for _ in range(G)]
        bs = self.block_size
        cap = (len(tokens) - 1) // bs
        self.extend_hashes(tokens, hashes, cap)
        found = [[self.cached.get((g, h)) for h in hashes[:cap]] for g in range(G)]
        k = cap  # the full groups' common chain
        for g, w in enumerate(self.windows):
            if w is None:
                k = next((i for i, b in enumerate(found[g][:k]) if b is None), k)
        while k > 0 and not all(  # each sliding group's blocks inside the window at the hit's end
                None not in found[g][first_live_block(k * bs, w, bs):k] for g, w in enumerate(self.windows) if w):
            k -= 1
        out = [[NULL_BLOCK] * first_live_block(k * bs, w, bs) + found[g][first_live_block(k * bs, w, bs):k]
               for g, w in enumerate(self.windows)]
        if count:
            self.queries += len(tokens)
            self.hits += k * bs
        return out

    def register(self, blocks: list[int], hashes: list[BlockHash], start: int, end: int, group: int = 0) -> None:
        """Register ``blocks[start:end]`` of ``group`` (full and computed) under ``hashes[start:end]``. A hash
        already cached keeps its first block (the duplicate stays unregistered, freed as a plain block): block
        tables are append-only, so a running sequence's block is never swapped for the cached twin."""
        if not self.enable_prefix_caching:
            return
        for i in range(start, end):
            key, b = (group, hashes[i]), blocks[i]
            if b != NULL_BLOCK and key not in self.cached and self.hash_of[b] is None:
                self.cached[key] = b
                self.hash_of[b] = key

    # ---- allocation ------------------------------------------------------------------------------
    def take(self, blocks: list[int]) -> None:
        """A sequence reuses cached ``blocks``: reference + 1 (out of the free queue when unreferenced)."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` new blocks (reference 1), evicting the least recently freed cached ones; None (and nothing
        taken) when fewer than ``n`` are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            key = self.hash_of[b]
            if key is not None:  # evict: its prefix is no longer found
                self.hash_of[b] = None
                if self.cached.get(key) == b:
                    del self.cached[key]
            self.ref[b] = 1
            out.append(b)
        # in ascending order: the free queue holds released sequences' blocks last-first, and a sequence whose
        # blocks run backwards, or are scattered, is read from memory in short runs; sorted, the blocks one
        # release gave back are read in one run again (the same blocks are taken: eviction order is unchanged)
        out.sort()
        return out

    def release(self, blocks: list[int]) -> None:
        """A sequence lets go of ``blocks`` (its whole list, in position order): reference - 1. Freed ones join
        the free queue tail-block first, so a sequence's later blocks are evicted before its earlier ones
        (a prefix is more likely to be shared than its continuation)."""
        for b in reversed(blocks):
            if b == NULL_BLOCK:
                continue
            r = self.ref[b] - 1
            if r < 0:
                raise RuntimeError(f"KV block {b} released more often than taken")
            self.ref[b] = r
            if r == 0:
                self.free[b] = None  # a new key: appended at the tail

    def drop_behind(self, blocks: list[list[int]], next_pos: int) -> None:
        """A sequence's next query is at ``next_pos``: its sliding groups give back the blocks behind their
        window (entries become ``NULL_BLOCK``; a registered one stays findable until evicted)."""
        bs = self.block_size
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            row = blocks[g]
            for i in range(min(first_live_block(next_pos, w, bs), len(row)) - 1, -1, -1):
                if row[i] == NULL_BLOCK:  # dropped before, and so is every entry before it
                    break
                self.release([row[i]])
                row[i] = NULL_BLOCK

    # ---- checks ----------------------------------------------------------------------------------
    def leaks(self) -> list[str]:
        """Inconsistencies, for tests and the soak: with no sequence running, every block must be free (cached
        or not). Also checks the free queue against the reference counts and the cache against the hashes."""
        out = []
        held = [b for b in range(self.num_blocks) if self.ref[b] != 0]
        if held:
            out.append(f"{len(held)} block(s) still referenced: {held[:16]}")
        bad = [b for b in range(self.num_blocks) if (self.ref[b] == 0) != (b in self.free)]
        if bad:
            out.append(f"free queue disagrees with reference counts for blocks {bad[:16]}")
        wrong = [f"{g}:{h.hex()[:8]}" for (g, h), b in self.cached.items() if self.hash_of[b] != (g, h)]
        if wrong:
            out.append(f"cached hashes without their block: {wrong[:8]}")
        return out

    def check_no_leaks(self) -> None:
        problems = self.leaks()
        if problems:
            raise AssertionError("KV block leak: " + "; ".join(problems))
