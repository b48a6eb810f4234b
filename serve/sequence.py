"""What the engine's parts share about one generation: the :class:`Sequence` (prompt, tokens, slot, progress,
per-sequence sampler and detokenizer) and the :class:`Event` it produces each step.

Its own module so that the scheduler, runner, engine and request stream can all name it without importing
each other."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serve.sampling import SamplerState, SamplingParams

_ids = itertools.count()


@dataclass
class TokenInfo:
    token_id: int
    text: str
    logprob: float | None = None
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Event:
    """What a sequence produced in one step: a text delta (maybe empty, held back for stop strings or
    incomplete UTF-8), the new token (with logprobs when asked), and on the last one finish_reason."""

    text: str = ""
    token: TokenInfo | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None


class Sequence:
    """One prompt's generation. ``sink`` receives its Events, on the engine's thread."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Event], None],
                 vocab_size: int):
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sink = sink
        self.sampler = SamplerState(params, self.prompt_ids, vocab_size)
        self.detok = None  # serve.detokenizer.IncrementalDetokenizer, set by Engine.submit (it holds the tokenizer)
        self.tokens = list(prompt_ids)  # prompt + generated: what the runner feeds the model
        self.out_ids: list[int] = []
        self.slot: int | None = None  # the running sequence's index in the model (its block-table row)
        self.computed = 0  # tokens whose K/V are in the cache
        # tokens to compute before decoding: the prompt, or after a preemption the prompt + generated tokens
        # (recomputed, the last chunk samples the next new token: nothing already streamed is produced again)
        self.prefill_len = len(self.prompt_ids)
        # paged KV cache (serve.kv_blocks): per KV group, the blocks holding positions 0.., in order (NULL_BLOCK
        # where a sliding group dropped them; [] while it holds none); the chain hashes of its full blocks (kept
        # across preemptions: its tokens only grow); how many of its blocks are registered
        self.blocks: list[list[int]] = []
        self.block_hashes: list[bytes] = []
        self.num_registered = 0
        self.num_preemptions = 0
        self.cache_hit = 0  # prompt tokens found in the prefix cache at its first admission
        self.cancelled = False
        self.finished = False
        self.finish_reason: str | None = None
        self.arrival = time.monotonic()
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prefill_len
