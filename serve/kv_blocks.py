"""The paged KV cache's block allocator: which physical blocks are free, who holds each one, and which full blocks
hold which tokens (automatic prefix caching).

Modelled on vLLM v1's ``BlockPool`` and ``KVCacheManager`` (vllm/v1/core/), kept small:

- the model's K/V cache is ``num_blocks`` blocks of ``block_size`` positions (in every layer); a sequence holds a
  list of block ids covering its positions in order (its row of ``SlotModel.block_table``);
- every block has a reference count: the sequences whose block list holds it. A block whose count drops to 0 goes
  to the tail of the free queue, which is also the eviction order (LRU): an allocation takes the queue's head;
- a *full* block of a sequence (``block_size`` computed tokens) is registered under a chain hash,
  ``H(parent block's hash, its token ids)``, so the hash names the whole prefix up to the block's end. A later
  sequence whose tokens start with the same prefix takes those blocks (reference count + 1) instead of computing
  them again. A registered block keeps its hash while free, and is reusable until an allocation evicts it;
- shared blocks are never written: a sequence reuses at most ``(len(tokens) - 1) // block_size`` blocks, so at
  least its last token is computed (its logits give the next token) and every write lands in a block of its own.

The hash is SHA-256 over the parent's digest and the block's token ids (collision-safe across requests, about a
microsecond a block). Not thread-safe: the scheduler calls it under its lock.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """The chain hash of one full block: its tokens, and (through ``parent``) every token before them."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks covering positions ``0 .. num_tokens - 1``."""
    return -(-num_tokens // block_size)


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` tokens: allocation, reference counts and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[BlockHash | None] = [None] * num_blocks  # the hash a block is registered under
        self.cached: dict[BlockHash, int] = {}  # hash -> block id (the first block registered under it)
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

    # ---- prefix cache ----------------------------------------------------------------------------
    def extend_hashes(self, tokens: list[int], hashes: list[BlockHash], num_full: int) -> list[BlockHash]:
        """Grow ``hashes`` (a sequence's chain hashes, kept on it across steps) to its first ``num_full`` full
        blocks of ``tokens``; returns it. Blocks already hashed are not hashed again."""
        bs = self.block_size
        for i in range(len(hashes), num_full):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def match(self, tokens: list[int], hashes: list[BlockHash], count: bool = True) -> list[int]:
        """The longest chain of cached blocks that ``tokens`` starts with, capped at ``(len(tokens) - 1) //
        block_size`` blocks (the last token is always computed). Takes no reference (``take`` does).
        ``count``: add to the query/hit counters (a sequence's first admission; not its resumes)."""
        found: list[int] = []
        if self.enable_prefix_caching:
            self.extend_hashes(tokens, hashes, (len(tokens) - 1) // self.block_size)
            for h in hashes[:(len(tokens) - 1) // self.block_size]:
                b = self.cached.get(h)
                if b is None:
                    break
                found.append(b)
            if count:
                self.queries += len(tokens)
                self.hits += len(found) * self.block_size
        return found

    def register(self, blocks: list[int], hashes: list[BlockHash], start: int, end: int) -> None:
        """Register ``blocks[start:end]`` (full and computed) under ``hashes[start:end]``. A hash already cached
        keeps its first block (the duplicate stays unregistered, freed as a plain block): block tables are
        append-only, so a running sequence's block is never swapped for the cached twin."""
        if not self.enable_prefix_caching:
            return
        for i in range(start, end):
            h, b = hashes[i], blocks[i]
            if h not in self.cached and self.hash_of[b] is None:
                self.cached[h] = b
                self.hash_of[b] = h

    # ---- allocation ------------------------------------------------------------------------------
    def take(self, blocks: list[int]) -> None:
        """A sequence reuses cached ``blocks``: reference + 1 (out of the free queue when unreferenced)."""
        for b in blocks:
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
            h = self.hash_of[b]
            if h is not None:  # evict: its prefix is no longer found
                self.hash_of[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """A sequence lets go of ``blocks`` (its whole list, in position order): reference - 1. Freed ones join
        the free queue tail-block first, so a sequence's later blocks are evicted before its earlier ones
        (a prefix is more likely to be shared than its continuation)."""
        for b in reversed(blocks):
            r = self.ref[b] - 1
            if r < 0:
                raise RuntimeError(f"KV block {b} released more often than taken")
            self.ref[b] = r
            if r == 0:
                self.free[b] = None  # a new key: appended at the tail

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
        wrong = [h.hex()[:8] for h, b in self.cached.items() if self.hash_of[b] != h]
        if wrong:
            out.append(f"cached hashes without their block: {wrong[:8]}")
        return out

    def check_no_leaks(self) -> None:
        problems = self.leaks()
        if problems:
            raise AssertionError("KV block leak: " + "; ".join(problems))
