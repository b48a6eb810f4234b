"""A model-shaped stand-in with a real (token-id) KV cache, for engine tests without a network: it stores each
fed token at its cache position (through the block table when paged, in its slot's row when static) and
"predicts" a token that depends on every token read back from its cache. So a wrong block table, a block shared
and then overwritten, or a position computed twice with other tokens all change the output, and the reference
(:func:`reference`) is a plain function of the true token sequence."""

from __future__ import annotations

import torch

from memfit.runtime.kv_groups import group_layers
from memfit.runtime.slot_model import Segment

VOCAB = 97


def next_token(prefix: list[int]) -> int:
    """The fake's prediction after ``prefix``: a rolling hash of all of it."""
    h = 7
    for t in prefix:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, computed without any cache."""
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class FakeKVModel:
    """``paged=True``: ``num_blocks`` x ``block_size`` cache and a block table the engine writes; else static slots
    of ``max_seq_len`` positions. ``forward`` checks that every written position lies in an owned block."""

    def __init__(self, max_batch: int, max_seq_len: int, num_blocks: int | None = None,
                 block_size: int | None = None):
        self.max_batch, self.max_seq_len, self.vocab_size = max_batch, max_seq_len, VOCAB
        self.paged = block_size is not None
        self.block_size = block_size or max_seq_len
        self.num_blocks = num_blocks or max_batch
        self.max_blocks_per_seq = -(-max_seq_len // self.block_size)
        self.block_table = torch.arange(max_batch).unsqueeze(1).repeat(1, self.max_blocks_per_seq) \
            if not self.paged else torch.full((max_batch, self.max_blocks_per_seq), -1, dtype=torch.long)
        self.block_tables = self.block_table[None]  # one KV group (no sliding window)
        self.kv_groups = group_layers([None])
        self.cache = torch.full((self.num_blocks, self.block_size), -1, dtype=torch.long)
        self.bytes_per_block = 2 * 4 * self.block_size
        self.cache_bytes = self.num_blocks * self.bytes_per_block
        self.tokens_computed = 0  # every token fed, over all forwards

    def _where(self, slot: int, pos: int) -> tuple[int, int]:
        if not self.paged:
            return slot, pos
        b = int(self.block_table[slot, pos // self.block_size])
        assert 0 <= b < self.num_blocks, f"slot {slot} position {pos}: no block ({b})"
        return b, pos % self.block_size

    def forward(self, input_ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        ids = input_ids.tolist()
        rows = []
        off = 0
        for seg in segments:
            for j in range(seg.length):
                b, o = self._where(seg.slot, seg.start + j)
                self.cache[b, o] = ids[off + j]
            off += seg.length
            self.tokens_computed += seg.length
            if seg.want_logits:
                end = seg.start + seg.length
                prefix = [int(self.cache[self._where(seg.slot, p)]) for p in range(end)]
                assert -1 not in prefix, "read a position never written"
                row = torch.zeros(VOCAB)
                row[next_token(prefix)] = 1.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)


class FakeTokenizer:
    """Just enough of a tokenizer for the engine's detokenizer: token t is the character chr(65 + t)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(65 + int(t)) for t in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(65 + int(t)) for t in ids]
