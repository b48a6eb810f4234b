"""The paged KV cache's scheduling, without a network: admission by free blocks, preemption by recompute (order,
resume), the prefix cache, and whole engine runs on a fake model whose output depends on every token it reads
back through the block table (tests/serve/fake_kv_model.py), so a wrong table or a shared block overwritten
shows as a wrong token."""

from __future__ import annotations

import random
import threading

import pytest

from serve.engine import Engine, Event, Sequence
from serve.kv_blocks import BlockPool
from serve.sampling import SamplingParams
from serve.scheduler import QueueFull, Scheduler

from .fake_kv_model import VOCAB, FakeKVModel, FakeTokenizer, reference

EOS = 2


def _seq(prompt_len: int, max_tokens: int = 8, start: int = 10) -> Sequence:
    return Sequence(list(range(start, start + prompt_len)), SamplingParams(max_tokens=max_tokens, temperature=0.0),
                    lambda ev: None, 1000)


def _sched(num_blocks: int, block_size: int = 4, max_batch: int = 4, chunk: int = 64, max_queue: int = 8,
           caching: bool = True) -> Scheduler:
    return Scheduler(max_batch, 256, chunk, max_queue, {EOS}, BlockPool(num_blocks, block_size, caching))


def _run(sch: Scheduler, plan, token: int = 5) -> None:
    sampled = [token if s.computed + n == len(s.tokens) else None
               for s, n in zip(plan.seqs, plan.num_tokens, strict=True)]
    sch.update_from_output(plan, sampled)


def _steps(plan) -> list[tuple[Sequence, int]]:
    return list(zip(plan.seqs, plan.num_tokens, strict=True))


def test_admission_waits_for_blocks_fifo_without_skipping():
    sch = _sched(num_blocks=6)
    a, b, c, d = _seq(10), _seq(10, start=40), _seq(10, start=70), _seq(2, start=90)
    sch.add([a, b, c, d])
    plan = sch.schedule()
    # 3 blocks each: a and b fill the pool; c waits although slots are free, and d (small) does not skip it
    assert _steps(plan) == [(a, 10), (b, 10)] and plan.admitted == [a, b]
    assert list(sch.waiting) == [c, d] and len(a.blocks[0]) == len(b.blocks[0]) == 3 and sch.pool.num_free == 0
    assert sch.kv_usage() == 1.0
    a.cancelled = True
    plan = sch.schedule()  # a's blocks come back: c is admitted, d still does not fit
    assert plan.aborted == [a] and plan.admitted == [c] and list(sch.waiting) == [d]


def test_admission_leaves_room_for_the_running_sequences_and_its_whole_prompt():
    # 3 blocks of 4; a (6 tokens + 1 new) takes 2. b's first chunk (2 tokens, the step's budget left) would fit
    # the free block, but its whole prompt (2 blocks) would not: admitting it would preempt a (or b) a step later
    sch = _sched(num_blocks=3, chunk=8)
    a, b = _seq(6, max_tokens=2), _seq(8, max_tokens=1, start=40)
    sch.add([a, b])
    plan = sch.schedule()
    assert _steps(plan) == [(a, 6)] and plan.admitted == [a] and list(sch.waiting) == [b]
    _run(sch, plan)
    plan = sch.schedule()  # a decodes: one more block may come soon, b still waits
    assert _steps(plan) == [(a, 1)] and list(sch.waiting) == [b]
    _run(sch, plan)
    assert a.finished
    plan = sch.schedule()
    assert plan.admitted == [b] and _steps(plan) == [(b, 8)] and sch.num_preemptions == 0
    assert sch.pool.queries == 6 + 8  # b waited two steps: its prefix-cache lookup counts once


def test_prefill_chunk_allocates_only_the_blocks_of_its_tokens():
    sch = _sched(num_blocks=10, chunk=5)
    a = _seq(18)
    sch.add([a])
    plan = sch.schedule()
    assert _steps(plan) == [(a, 5)] and len(a.blocks[0]) == 2
    _run(sch, plan)
    plan = sch.schedule()
    assert _steps(plan) == [(a, 5)] and a.computed == 5 and len(a.blocks[0]) == 3


def _until_preempted(sch: Scheduler):
    plan = sch.schedule()
    for _ in range(50):
        if plan.preempted:
            return plan
        _run(sch, plan)
        plan = sch.schedule()
    raise AssertionError("no preemption")


def test_decode_out_of_blocks_preempts_the_most_recent_and_resumes_it():
    sch = _sched(num_blocks=6, block_size=4, caching=False)
    a, b = _seq(7, max_tokens=14), _seq(7, max_tokens=14, start=50)  # 20 positions: 5 blocks each at the end
    sch.add([a, b])
    plan = sch.schedule()
    assert _steps(plan) == [(a, 7), (b, 7)] and sch.pool.num_free == 2
    assert sch.pool.queries == 0  # prefix caching off: no lookups to count
    plan = _until_preempted(sch)
    # position 12 needs a fourth block each: a (admitted first) gets it by preempting b (the most recent)
    assert plan.preempted == [b] and _steps(plan) == [(a, 1)] and list(sch.waiting) == [b]
    assert a.computed == 12 and len(a.blocks[0]) == 4
    assert b.slot is None and b.blocks == [] and b.computed == 0 and b.prefill_len == 13 == len(b.tokens)
    assert b.out_ids == [5] * 6 and sch.num_preemptions == 1 and b.num_preemptions == 1
    # a runs on; b waits (none admitted while memory is short) until the pool holds its first chunk
    while b.slot is None:
        _run(sch, plan)
        plan = sch.schedule()
    assert plan.admitted == [] and (b, 13) in _steps(plan)  # resumed: prompt + 6 generated, recomputed
    _run(sch, plan, token=6)
    assert b.out_ids == [5] * 6 + [6] and not b.in_prefill and b.computed == 13
    while sch.has_work():
        _run(sch, sch.schedule())
    assert len(a.out_ids) == len(b.out_ids) == 14 and sch.pool.leaks() == []


def test_preemption_skips_sequences_planned_before_and_can_hit_the_needy_one_itself():
    sch = _sched(num_blocks=6, block_size=4, caching=False)
    a, b = _seq(7, max_tokens=14), _seq(3, max_tokens=14, start=50)
    sch.add([a, b])
    plan = _until_preempted(sch)
    # b (the tail) is preempted whether a or b itself ran short; a keeps running
    assert plan.preempted == [b] and [s for s, _ in _steps(plan)] == [a] and sch.running == [a]


def test_resume_hits_its_own_cached_blocks():
    sch = _sched(num_blocks=6, block_size=4)
    a, b = _seq(7, max_tokens=14), _seq(7, max_tokens=14, start=50)
    sch.add([a, b])
    plan = _until_preempted(sch)
    assert plan.preempted == [b]
    while b.slot is None:
        _run(sch, plan)
        plan = sch.schedule()
    # b's three full blocks (positions 0-11, generated tokens included) were registered; freed tail first,
    # a's growth took (evicted) blocks 2 and 1, block 0 was still cached: b recomputes positions 4-12 only
    assert (b, 9) in _steps(plan) and b.computed == 4 and b.in_prefill
    assert sch.pool.queries == 14  # resumes are not counted as queries


def test_prefix_cache_hit_computes_only_the_rest_and_counts():
    sch = _sched(num_blocks=16, block_size=4)
    a = _seq(10, max_tokens=3)
    sch.add([a])
    _run(sch, sch.schedule())
    b = _seq(13, max_tokens=3)  # same first 10 tokens (+ 3)
    sch.add([b])
    plan = sch.schedule()
    # a's blocks 0 and 1 (positions 0-7) are full and registered: b reuses both, shares them
    assert _steps(plan) == [(a, 1), (b, 5)] and b.blocks[0][:2] == a.blocks[0][:2] and b.cache_hit == 8
    assert sch.pool.ref[a.blocks[0][0]] == 2 and sch.pool.queries == 23 and sch.pool.hits == 8
    while sch.has_work():
        _run(sch, sch.schedule())
    assert sch.pool.leaks() == [] and sch.pool.num_cached >= 2


def test_too_large_for_the_whole_pool_fails_at_admission():
    sch = _sched(num_blocks=3, block_size=4)
    big, small = _seq(10, max_tokens=5), _seq(3, max_tokens=2, start=60)  # big: 14 positions = 4 blocks
    sch.add([big, small])
    plan = sch.schedule()
    assert [s for s, _ in plan.failed] == [big] and big.finish_reason == "error" and "3" in plan.failed[0][1]
    assert plan.admitted == [small]


def test_queue_full_rule_holds_in_paged_mode():
    sch = _sched(num_blocks=4, max_batch=2, max_queue=1)
    sch.add([_seq(2), _seq(2), _seq(2)])
    with pytest.raises(QueueFull):
        sch.add([_seq(2)])
    sch.schedule()
    assert len(sch.running) == 2 and len(sch.waiting) == 1  # max_batch caps the running ones
    with pytest.raises(QueueFull):
        sch.add([_seq(2)])


# ---- whole engine on the fake model --------------------------------------------------------------------------
class Collector:
    def __init__(self):
        self.ids: list[int] = []
        self.reason: str | None = None
        self.error: str | None = None
        self.done = threading.Event()

    def __call__(self, ev: Event):
        if ev.token is not None:
            self.ids.append(ev.token.token_id)
        if ev.finish_reason is not None:
            self.reason, self.error = ev.finish_reason, ev.error
            self.done.set()


def _run_engine(model: FakeKVModel, prompts: list[list[int]], max_tokens: list[int], chunk: int = 8,
                caching: bool = True) -> tuple[list[Collector], Engine]:
    eng = Engine(model, FakeTokenizer(), set(), prefill_chunk=chunk, max_queue=256, prefix_caching=caching)
    cols = []
    try:
        seqs = []
        for p, m in zip(prompts, max_tokens, strict=True):
            c = Collector()
            # logprobs=0: each Event carries its token id, so the test sees the ids
            seqs.append(Sequence(p, SamplingParams(max_tokens=m, temperature=0.0, logprobs=0), c, VOCAB))
            cols.append(c)
        eng.submit(seqs)
        for c in cols:
            assert c.done.wait(30)
    finally:
        eng.stop()
    return cols, eng


def _workload(n: int, seed: int, shared: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(VOCAB) for _ in range(shared)]
    prompts = [head + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    return prompts, [rng.randint(1, 25) for _ in range(n)]


@pytest.mark.parametrize("caching", [True, False])
def test_engine_paged_with_preemption_equals_reference_and_returns_every_block(caching):
    prompts, outs = _workload(24, seed=3, shared=9)
    model = FakeKVModel(max_batch=6, max_seq_len=64, num_blocks=16, block_size=4)  # one max_seq_len sequence
    cols, eng = _run_engine(model, prompts, outs, caching=caching)
    for p, m, c in zip(prompts, outs, cols, strict=True):
        assert c.reason == "length" and c.ids == reference(p, m)
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv_leaks() == [] and eng.pool.num_free == 16
    assert (eng.pool.hits > 0) == caching


def test_engine_static_fake_equals_reference():
    prompts, outs = _workload(10, seed=4)
    model = FakeKVModel(max_batch=3, max_seq_len=64)
    cols, eng = _run_engine(model, prompts, outs)
    assert eng.pool is None and eng.kv_info()["paged"] is False
    for p, m, c in zip(prompts, outs, cols, strict=True):
        assert c.ids == reference(p, m)


def test_engine_prefix_hit_computes_fewer_tokens_same_output():
    prompt = list(range(40, 80))
    model = FakeKVModel(max_batch=4, max_seq_len=128, num_blocks=32, block_size=8)
    cols, eng = _run_engine(model, [prompt], [6])
    first = model.tokens_computed  # 40 prompt + 5 decodes
    cols2, eng2 = _run_engine(model, [prompt], [6])  # a new engine: a fresh pool, no hit
    assert model.tokens_computed - first == first
    eng3 = Engine(model, FakeTokenizer(), set(), prefill_chunk=64)
    try:
        got = []
        for _ in range(2):
            c = Collector()
            eng3.submit([Sequence(prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=0), c, VOCAB)])
            assert c.done.wait(30)
            got.append(c.ids)
    finally:
        eng3.stop()
    assert got[0] == got[1] == cols[0].ids == cols2[0].ids == reference(prompt, 6)
    # second request: 39 // 8 = 4 blocks (32 tokens) found, 8 prompt tokens computed
    assert model.tokens_computed - 2 * first == first + (first - 32)
    assert eng3.pool.hits == 32 and eng3.pool.queries == 80 and eng3.kv_info()["prefix_cache_hits"] == 32


def test_engine_reports_a_sequence_larger_than_the_cache_as_an_error():
    model = FakeKVModel(max_batch=2, max_seq_len=64, num_blocks=2, block_size=4)
    cols, eng = _run_engine(model, [list(range(10)), [1, 2, 3]], [4, 3])
    assert cols[0].reason == "error" and "the cache has 2" in cols[0].error and cols[0].ids == []
    assert cols[1].reason == "length" and cols[1].ids == reference([1, 2, 3], 3)
    assert eng.kv_leaks() == []
