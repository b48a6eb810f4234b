"""Engine-level tests: slot-cache forward vs HF, chunked prefill, continuous batching, sampling, cancel."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from memfit.runtime.slot_model import Segment, SlotModel
from serve.engine import Engine, EngineStopped, Event, Sequence
from serve.loader import load
from serve.sampling import SamplerState, SamplingParams

from .conftest import hf_greedy


def _engine(loaded, max_batch=4, max_seq=256, chunk=16, max_queue=64):
    sm = SlotModel(loaded.model, max_batch, max_seq)
    return Engine(sm, loaded.tokenizer, loaded.eos_ids, prefill_chunk=chunk, max_queue=max_queue)


class Collector:
    def __init__(self):
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, ev: Event):
        self.events.append(ev)
        if ev.finish_reason is not None:
            self.done.set()

    @property
    def text(self):
        return "".join(e.text for e in self.events)


def _seq(loaded, ids, **kw):
    c = Collector()
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 12)
    return Sequence(ids, SamplingParams(**kw), c, loaded.model.config.vocab_size), c


def test_packed_forward_matches_hf_logits(loaded):
    torch.manual_seed(1)
    V = loaded.model.config.vocab_size
    sm = SlotModel(loaded.model, 4, 128)
    a, b, c = torch.randint(7, V, (30,)), torch.randint(7, V, (9,)), torch.randint(7, V, (21,))
    with torch.no_grad():
        ref = {k: loaded.model(x[None]).logits[0].float() for k, x in (("a", a), ("b", b), ("c", c))}
    # step 1: prefill a[:20] (slot 2) and b[:8] (slot 0) together
    out = sm.forward(torch.cat([a[:20], b[:8]]), [Segment(2, 0, 20), Segment(0, 0, 8)])
    torch.testing.assert_close(out[0], ref["a"][19], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], ref["b"][7], atol=1e-4, rtol=1e-4)
    # step 2: decode b (slot 0), continue a's prefill from position 20, start c (slot 3)
    out = sm.forward(torch.cat([b[8:9], a[20:], c]), [Segment(0, 8, 1), Segment(2, 20, 10), Segment(3, 0, 21)])
    torch.testing.assert_close(out[0], ref["b"][8], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], ref["a"][29], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[2], ref["c"][20], atol=1e-4, rtol=1e-4)
    # non-contiguous decode slots
    out = sm.forward(torch.tensor([5, 6]), [Segment(3, 21, 1), Segment(0, 9, 1)])
    with torch.no_grad():
        r3 = loaded.model(torch.cat([c, torch.tensor([5])])[None]).logits[0, -1]
        r0 = loaded.model(torch.cat([b, torch.tensor([6])])[None]).logits[0, -1]
    torch.testing.assert_close(out[0], r3, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], r0, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("path", ["python", "cpp"])
def test_chunked_prefill_logits_equal_unchunked(loaded, model_dir, chunk, path):
    torch.manual_seed(2)
    ids = torch.randint(7, loaded.model.config.vocab_size, (150,))
    if path == "cpp":
        # the server's default: the C++ layer loop. Packing rewrites modules, so on a model of its own: not a
        # deepcopy of the shared one, which a live server of an earlier test may have packed already (its panel
        # Linears hold the kernels' Python module, which cannot be copied)
        sm = SlotModel(load(model_dir).model, 2, 256, dense_kernel="on", cpu_kernels="on")
        assert sm.stack is not None
    else:
        sm = SlotModel(loaded.model, 2, 256)
        assert sm.stack is None
    full = sm.forward(ids, [Segment(0, 0, 150)])[0]
    last = None
    for s in range(0, 150, chunk):
        n = min(chunk, 150 - s)
        last = sm.forward(ids[s:s + n], [Segment(1, s, n, want_logits=s + n == 150)])
    torch.testing.assert_close(last[0], full, atol=1e-5, rtol=1e-5)
    # and the caches agree, so later decodes agree too
    kc = torch.stack(sm.k_cache)  # [layers, slots, kv heads, positions, head_dim]
    torch.testing.assert_close(kc[:, 1, :, :150], kc[:, 0, :, :150], atol=1e-5, rtol=1e-5)


def test_continuous_batching_greedy_equals_hf_generate(loaded):
    tok = loaded.tokenizer
    prompts = ["ROMEO. But soft", "To be, or not to be, that is the question: whether 'tis nobler in the mind",
               "O", "MACBETH. Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day. " * 3,
               "We are such stuff", "JULIET."]
    eng = _engine(loaded, max_batch=3, chunk=8)  # 6 requests > 3 slots: join/leave while others run
    try:
        seqs = []
        for i, p in enumerate(prompts):
            s, c = _seq(loaded, tok(p)["input_ids"], max_tokens=10 + 3 * i, ignore_eos=True)
            seqs.append((s, c))
        eng.submit([s for s, _ in seqs[:2]])
        time.sleep(0.05)
        eng.submit([s for s, _ in seqs[2:]])
        for s, c in seqs:
            assert c.done.wait(60)
            assert c.events[-1].finish_reason == "length"
            assert s.out_ids == hf_greedy(loaded, s.prompt_ids, s.params.max_tokens)
            assert c.text == tok.decode(s.out_ids, skip_special_tokens=True)
        assert eng.num_running() == 0 and sorted(eng.free_slots) == [0, 1, 2]
    finally:
        eng.stop()


def test_each_step_runs_all_decodes_then_bounded_prefill(loaded):
    eng = _engine(loaded, max_batch=4, chunk=16)
    seen = []
    eng.step_hook = lambda segs: seen.append([(s.slot, s.length) for s in segs])
    try:
        short, c1 = _seq(loaded, [10, 11, 12], max_tokens=30, ignore_eos=True)
        eng.submit([short])
        while not short.out_ids:
            time.sleep(0.001)
        long_, c2 = _seq(loaded, list(range(7, 107)), max_tokens=2, ignore_eos=True)
        eng.submit([long_])
        assert c1.done.wait(30) and c2.done.wait(30)
    finally:
        eng.stop()
    mixed = [st for st in seen if len(st) == 2]
    assert mixed, "the long prefill was not interleaved with the running decode"
    for st in seen:
        assert sum(n for _, n in st if n > 1) <= 16  # prefill token budget per step
    for st in mixed:
        assert st[0][1] == 1  # the decode comes first


def test_seeded_sampling_is_per_request(loaded):
    ids = loaded.tokenizer("ROMEO.")["input_ids"]
    eng = _engine(loaded)
    try:
        runs = []
        for seed in (5, 5, 6):
            s, c = _seq(loaded, ids, temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=20, ignore_eos=True)
            eng.submit([s])
            assert c.done.wait(30)
            runs.append(s.out_ids)
        torch.manual_seed(123)  # the global RNG has no influence
        s, c = _seq(loaded, ids, temperature=1.0, top_p=0.9, top_k=50, seed=5, max_tokens=20, ignore_eos=True)
        eng.submit([s])
        assert c.done.wait(30)
    finally:
        eng.stop()
    assert runs[0] == runs[1] == s.out_ids
    assert runs[0] != runs[2]


def test_sampler_penalties_follow_openai_definitions():
    p = SamplingParams(max_tokens=1, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    st = SamplerState(p, prompt_ids=[1], vocab_size=5)
    for t in (2, 2, 3):
        st.observe(t)
    x = torch.tensor([1.0, 2.0, -2.0, 4.0, 0.5])
    got = st.process(x)
    # repetition (CTRL): seen tokens 1,2,3 -> positive /2, negative *2; then presence/frequency on generated
    exp = torch.tensor([1.0, 1.0, -4.0 - 0.5 - 2 * 0.25, 2.0 - 0.5 - 0.25, 0.5])
    torch.testing.assert_close(got, exp)


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for kw, allowed in (({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1}), ({"min_p": 0.4}, {0, 1}),
                        ({"top_p": 0.45}, {0})):
        st = SamplerState(SamplingParams(max_tokens=1, seed=0, **kw), [], 4)
        got = {st.sample(logits) for _ in range(200)}
        assert got == allowed, (kw, got)
    st = SamplerState(SamplingParams(max_tokens=1, temperature=0.0), [], 4)
    assert st.sample(logits) == 0


def test_stop_strings_truncate_and_hold_back(loaded):
    tok = loaded.tokenizer
    ids = tok("ROMEO. But soft")["input_ids"]
    eng = _engine(loaded)
    try:
        ref, c0 = _seq(loaded, ids, max_tokens=30, ignore_eos=True)
        eng.submit([ref])
        assert c0.done.wait(30)
        full = c0.text
        assert len(full) > 6
        stop = full[3:6]
        s, c = _seq(loaded, ids, max_tokens=30, ignore_eos=True, stop=["zzzz-never", stop])
        eng.submit([s])
        assert c.done.wait(30)
    finally:
        eng.stop()
    assert c.events[-1].finish_reason == "stop"
    assert c.text == full[:full.find(stop)]
    assert stop not in c.text


def test_cancel_frees_slot_within_one_step(loaded):
    eng = _engine(loaded, max_batch=2)
    steps_at_cancel = []
    try:
        s, c = _seq(loaded, [10, 11, 12], max_tokens=200, ignore_eos=True)
        eng.submit([s])
        while len(s.out_ids) < 3:
            time.sleep(0.001)
        steps_at_cancel.append(eng.steps)
        eng.abort(s)
        assert c.done.wait(10)
        assert c.events[-1].finish_reason == "abort"
        assert eng.steps - steps_at_cancel[0] <= 1
        assert sorted(eng.free_slots) == [0, 1] and eng.num_running() == 0
        # cancel while still waiting for a slot: never gets one
        a, ca = _seq(loaded, [10, 11], max_tokens=100, ignore_eos=True)
        b, cb = _seq(loaded, [10, 12], max_tokens=100, ignore_eos=True)
        w, cw = _seq(loaded, [10, 13], max_tokens=100, ignore_eos=True)
        eng.submit([a, b, w])
        eng.abort(w)
        assert cw.done.wait(10) and w.out_ids == []
        eng.abort(a)
        eng.abort(b)
        assert ca.done.wait(10) and cb.done.wait(10)
        assert eng.num_running() == 0 and eng.num_waiting() == 0
    finally:
        eng.stop()


def test_step_failure_fails_sequences_and_engine_keeps_serving(loaded):
    eng = _engine(loaded)
    boom = {"n": 1}

    def hook(segs):
        if boom["n"]:
            boom["n"] -= 1
            raise RuntimeError("injected fault")

    eng.step_hook = hook
    try:
        s, c = _seq(loaded, [10, 11], max_tokens=5)
        eng.submit([s])
        assert c.done.wait(10)
        assert c.events[-1].finish_reason == "error" and "injected fault" in c.events[-1].error
        s2, c2 = _seq(loaded, [10, 11], max_tokens=5, ignore_eos=True)
        eng.submit([s2])
        assert c2.done.wait(10) and c2.events[-1].finish_reason == "length"
    finally:
        eng.stop()


def test_engine_on_an_event_loop_serves_between_io_and_stops(loaded):
    """run_async: the loop steps as a task on the caller's event loop; other tasks run between steps."""
    import asyncio

    tok = loaded.tokenizer
    sm = SlotModel(loaded.model, 2, 256)
    eng = Engine(sm, loaded.tokenizer, loaded.eos_ids, prefill_chunk=8, own_thread=False)
    ticks: list[int] = []

    async def main():
        task = asyncio.ensure_future(eng.run_async())
        await asyncio.sleep(0.05)  # idle: the task waits for work instead of spinning
        assert not task.done() and eng.steps == 0

        async def ticker():  # an I/O stand-in: must get turns while the engine works
            while True:
                ticks.append(eng.steps)
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        seqs = [_seq(loaded, tok(p)["input_ids"], max_tokens=8, ignore_eos=True) for p in ("ROMEO. But soft", "O")
                + ("To be, or not to be",)]  # 3 requests, 2 slots
        eng.submit([s for s, _ in seqs])
        while not all(c.done.is_set() for _, c in seqs):
            await asyncio.sleep(0.01)
        t.cancel()
        await asyncio.to_thread(eng.stop)  # as the server's lifespan does
        await asyncio.wait_for(task, 10)
        return seqs

    seqs = asyncio.run(main())
    for s, c in seqs:
        assert c.events[-1].finish_reason == "length"
        assert s.out_ids == hf_greedy(loaded, s.prompt_ids, 8)
    assert len(set(ticks)) > 3  # the ticker ran between many different steps
    assert not eng.alive and eng.num_running() == 0
    with pytest.raises(EngineStopped):
        eng.submit([_seq(loaded, [1, 2, 3])[0]])


def test_batched_greedy_equals_each_rows_sample(monkeypatch):
    from serve.sampling import greedy_tokens

    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    logits[4, :] = float("nan")
    greedy = SamplerState(SamplingParams(max_tokens=4, temperature=0.0), [1, 2], 50)
    assert greedy.plain_greedy
    assert greedy_tokens(logits) == [greedy.sample(row) for row in logits]
    # vocabularies of whole 1,024-entry chunks and a tail: the chunked pass, ties to the first index
    for V in (4096, 3000):
        big = torch.randn(6, V, generator=torch.Generator().manual_seed(V))
        big[1, [5, 2000]] = 9.0  # a tie across chunks
        big[2, [1030, 1031]] = 9.0  # within a chunk
        big[3, V - 1] = 9.0  # the last entry (the tail where V has one)
        big[4, 2047] = float("nan")  # not finite: sample's rules
        big[5, 100] = float("inf")
        want = [greedy.sample(row) for row in big]
        assert want[1:4] == [5, 1030, V - 1]
        assert greedy_tokens(big) == want  # rows 4 and 5 send the batch to nan_to_num
        with monkeypatch.context() as m:  # finite rows never need it
            m.setattr(torch, "nan_to_num", None)
            assert greedy_tokens(big[:4]) == want[:4]
    assert not SamplerState(SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.2), [1], 50).plain_greedy
    assert not SamplerState(SamplingParams(max_tokens=4, temperature=0.7), [1], 50).plain_greedy


@pytest.mark.parametrize("on_loop", [False, True])
def test_request_stream_delivers_each_sequences_events_in_order(loaded, on_loop):
    """A RequestStream gets every sequence's Events, tagged with its index, from an engine on its own thread or
    on the stream's event loop; on the loop they go straight into the queue, not through the loop's threadsafe
    wake-up (a self-pipe write per token)."""
    import asyncio

    from serve.stream import RequestStream

    tok = loaded.tokenizer
    sm = SlotModel(loaded.model, 2, 256)
    prompts = ["ROMEO. But soft", "O", "To be, or not to be"]  # 3 sequences, 2 slots

    async def main():
        eng = Engine(sm, tok, loaded.eos_ids, prefill_chunk=8, own_thread=not on_loop)
        task = asyncio.ensure_future(eng.run_async()) if on_loop else None
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]
        try:
            stream = RequestStream(eng, loaded.model.config.vocab_size)
            for p in prompts:
                stream.add(tok(p)["input_ids"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
            stream.submit()
            got: dict[int, list[Event]] = {0: [], 1: [], 2: []}
            async for idx, ev in stream:
                assert got[idx] == [] or got[idx][-1].finish_reason is None  # nothing after the last Event
                got[idx].append(ev)
        finally:
            del loop.call_soon_threadsafe
            await asyncio.to_thread(eng.stop)
            if task is not None:
                await asyncio.wait_for(task, 10)
        return stream, got, wakeups

    stream, got, wakeups = asyncio.run(main())
    for i, s in enumerate(stream.seqs):
        assert got[i][-1].finish_reason == "length" and len(s.out_ids) == 10
        assert "".join(e.text for e in got[i]) == tok.decode(s.out_ids, skip_special_tokens=True)
        assert s.out_ids == hf_greedy(loaded, s.prompt_ids, 10)
    if on_loop:
        assert len(wakeups) <= 2  # the submit's wake-up, not one per token
    else:
        assert len(wakeups) >= 30  # every Event crossed threads
