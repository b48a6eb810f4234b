"""Scheduler alone (no model): step plans, FIFO admission without preemption, cancellation, the queue-full rule
and closing a step (EOS, max_tokens)."""

from __future__ import annotations

import pytest

from serve.sampling import SamplingParams
from serve.scheduler import EngineStopped, QueueFull, Scheduler
from serve.sequence import Sequence

EOS = 2


def _seq(prompt_len: int, max_tokens: int = 100, **kw) -> Sequence:
    return Sequence(list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw),
                    lambda ev: None, 1000)


def _sched(max_batch=4, chunk=16, max_queue=8) -> Scheduler:
    return Scheduler(max_batch, 512, chunk, max_queue, {EOS})


def _run(sch: Scheduler, plan, token: int = 5) -> None:
    """Close ``plan`` as the engine would: a token for every sequence that reached the end of its tokens."""
    sampled = [token if s.computed + n == len(s.tokens) else None for s, n in zip(plan.seqs, plan.num_tokens,
                                                                                  strict=True)]
    sch.update_from_output(plan, sampled)


def test_plan_is_decodes_then_prefill_chunks_within_budget():
    sch = _sched(max_batch=4, chunk=16)
    a, b = _seq(3), _seq(5)
    sch.add([a, b])
    plan = sch.schedule()
    assert [(s, n) for s, n in zip(plan.seqs, plan.num_tokens, strict=True)] == [(a, 3), (b, 5)]
    assert plan.num_decodes == 0
    _run(sch, plan)
    assert a.out_ids == [5] and b.out_ids == [5] and not a.in_prefill
    c, d = _seq(10), _seq(30)  # 40 prompt tokens: more than one step's budget
    sch.add([c, d])
    plan = sch.schedule()
    # a and b decode (1 token each) first, then c's whole prompt, then 6 of d's 30 (16 in all)
    assert list(zip(plan.seqs, plan.num_tokens, strict=True)) == [(a, 1), (b, 1), (c, 10), (d, 6)]
    assert plan.num_decodes == 2
    _run(sch, plan)
    assert d.computed == 6 and d.out_ids == [] and c.out_ids == [5]
    plan = sch.schedule()
    assert list(zip(plan.seqs, plan.num_tokens, strict=True)) == [(a, 1), (b, 1), (c, 1), (d, 16)]
    _run(sch, plan)
    plan = sch.schedule()
    assert list(zip(plan.seqs, plan.num_tokens, strict=True)) == [(a, 1), (b, 1), (c, 1), (d, 8)]
    _run(sch, plan)
    assert d.out_ids == [5] and d.computed == 30
    plan = sch.schedule()
    assert plan.num_decodes == 4 and plan.num_tokens == [1, 1, 1, 1]


def test_admission_is_fifo_and_never_preempts():
    sch = _sched(max_batch=2)
    seqs = [_seq(4, max_tokens=2), _seq(4, max_tokens=50), _seq(4), _seq(4)]
    sch.add(seqs[:1])
    sch.add(seqs[1:])
    plan = sch.schedule()
    assert plan.seqs == seqs[:2] and plan.admitted == seqs[:2]
    assert [s.slot for s in seqs] == [0, 1, None, None]
    _run(sch, plan)
    plan = sch.schedule()  # no slot free: the waiting ones wait, the running keep theirs
    assert plan.seqs == seqs[:2] and plan.admitted == []
    _run(sch, plan)  # seqs[0] reaches max_tokens=2 and leaves
    assert seqs[0].finished and seqs[0].finish_reason == "length" and seqs[0].slot is None
    plan = sch.schedule()
    assert plan.admitted == [seqs[2]] and seqs[2].slot == 0 and seqs[1].slot == 1 and seqs[3].slot is None
    assert plan.seqs == [seqs[1], seqs[2]]  # the running decode, then the newcomer's prefill


def test_queue_full_counts_free_slots_and_is_all_or_nothing():
    sch = _sched(max_batch=2, max_queue=1)
    sch.add([_seq(2), _seq(2), _seq(2)])  # 2 will get slots, 1 waits
    with pytest.raises(QueueFull):
        sch.add([_seq(2)])
    assert len(sch.waiting) == 3
    sch.schedule()  # 2 admitted: 1 waiting, no slot free
    with pytest.raises(QueueFull):
        sch.add([_seq(2)])
    sch2 = _sched(max_batch=2, max_queue=1)
    with pytest.raises(QueueFull):
        sch2.add([_seq(2)] * 4)
    assert len(sch2.waiting) == 0
    sch2.stopped = True
    with pytest.raises(EngineStopped):
        sch2.add([_seq(2)])


def test_cancelled_sequences_leave_before_the_step():
    sch = _sched(max_batch=2)
    a, b, c = _seq(3), _seq(3), _seq(3)
    sch.add([a, b, c])
    _run(sch, sch.schedule())
    a.cancelled = True
    c.cancelled = True  # still waiting: never gets a slot
    plan = sch.schedule()
    assert set(plan.aborted) == {a, c} and all(s.finish_reason == "abort" for s in (a, c))
    assert plan.seqs == [b] and c.slot is None and sorted(sch.free_slots) == [0]
    assert not sch.waiting


def test_update_from_output_finishes_on_eos_unless_ignored():
    sch = _sched()
    a, b = _seq(2), _seq(2, ignore_eos=True)
    sch.add([a, b])
    plan = sch.schedule()
    sch.update_from_output(plan, [EOS, EOS])
    assert a.finished and a.finish_reason == "stop" and a.out_ids == [EOS]
    assert not b.finished and b.tokens[-1] == EOS
    assert sch.running == [b] and sorted(sch.free_slots) == [0, 2, 3]


def test_simulated_run_prefills_every_prompt_token_once_and_drains():
    sch = _sched(max_batch=3, chunk=7)
    seqs = [_seq(n, max_tokens=m) for n, m in ((1, 3), (20, 2), (9, 5), (15, 1), (3, 4))]
    sch.add(seqs)
    fed = {s.id: 0 for s in seqs}
    steps = 0
    while sch.has_work():
        plan = sch.schedule()
        assert sum(plan.num_tokens[plan.num_decodes:]) <= 7
        assert all(n == 1 for n in plan.num_tokens[:plan.num_decodes])
        assert len(set(s.slot for s in plan.seqs)) == len(plan.seqs) <= 3
        for s, n in zip(plan.seqs, plan.num_tokens, strict=True):
            fed[s.id] += n
        _run(sch, plan)
        steps += 1
        assert steps < 100
    for s in seqs:
        assert s.finish_reason == "length" and len(s.out_ids) == s.params.max_tokens
        assert fed[s.id] == len(s.prompt_ids) + s.params.max_tokens - 1  # the last token is never fed back
    assert sorted(sch.free_slots) == [0, 1, 2]
