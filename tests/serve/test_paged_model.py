"""The paged KV cache on real (tiny) models through the engine: greedy tokens equal the static-slot engine's and
HF's (mixed batches, chunked prefill across block boundaries, GQA, Gemma 3's sliding layers), a prefix-cache hit
gives the same tokens and log-probabilities as a miss while computing fewer tokens, preemption by recompute in a
pool of one sequence's blocks changes nothing, and every block is back afterwards."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from memfit.runtime.slot_model import SlotModel
from serve.engine import Engine, Event, Sequence
from serve.sampling import SamplingParams

from .conftest import hf_greedy


class Out:
    def __init__(self):
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.reason: str | None = None
        self.done = threading.Event()

    def __call__(self, ev: Event):
        if ev.token is not None:
            self.ids.append(ev.token.token_id)
            self.logprobs.append(ev.token.logprob)
        if ev.finish_reason is not None:
            self.reason = ev.finish_reason
            self.done.set()


def _generate(sm, tok, prompts, max_tokens, chunk=7, prefix_caching=True, logprobs=None, one_by_one=False,
              used: list[int] | None = None):
    """Each prompt's greedy tokens from an engine on ``sm``; returns (outputs, engine, tokens fed per step).
    ``used``: gets the pool's blocks in use at each step."""
    eng = Engine(sm, tok, set(), prefill_chunk=chunk, max_queue=256, prefix_caching=prefix_caching)
    fed: list[int] = []

    def hook(segs):
        fed.append(sum(s.length for s in segs))
        if used is not None:
            used.append(eng.pool.num_used)

    eng.step_hook = hook
    outs = [Out() for _ in prompts]
    seqs = [Sequence(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True,
                                       logprobs=0 if logprobs is None else logprobs), o, sm.vocab_size)
            for p, m, o in zip(prompts, max_tokens, outs, strict=True)]
    try:
        if one_by_one:
            for s, o in zip(seqs, outs, strict=True):
                eng.submit([s])
                assert o.done.wait(60)
        else:
            eng.submit(seqs)
            for o in outs:
                assert o.done.wait(60)
    finally:
        eng.stop()
    assert all(o.reason == "length" for o in outs)
    return outs, eng, fed


def _prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def test_paged_greedy_equals_static_and_hf_mixed_batch_chunks_across_blocks(loaded):
    """GQA (4 heads, 2 KV heads); block size 4 and prefill chunks of 7 tokens cross block boundaries."""
    V = loaded.model.config.vocab_size
    prompts = _prompts(V, [3, 17, 9, 30, 1, 12])
    mt = [9, 5, 14, 6, 11, 8]
    static, _, _ = _generate(SlotModel(loaded.model, 4, 64), loaded.tokenizer, prompts, mt)
    paged, eng, _ = _generate(SlotModel(loaded.model, 4, 64, num_blocks=64, block_size=4), loaded.tokenizer, prompts,
                              mt)
    for p, m, s, q in zip(prompts, mt, static, paged, strict=True):
        assert q.ids == s.ids == hf_greedy(loaded, p, m)
    assert eng.kv_leaks() == [] and eng.kv_info()["paged"] is True


def test_preemption_in_a_pool_of_one_sequence_gives_the_same_tokens(loaded):
    V = loaded.model.config.vocab_size
    prompts = _prompts(V, [20, 11, 26, 5, 14], seed=1)
    mt = [30, 25, 20, 35, 28]
    ref, _, _ = _generate(SlotModel(loaded.model, 4, 64), loaded.tokenizer, prompts, mt)
    for caching in (True, False):
        sm = SlotModel(loaded.model, 4, 64, num_blocks=16, block_size=4)  # 64 positions: one full sequence
        out, eng, _ = _generate(sm, loaded.tokenizer, prompts, mt, prefix_caching=caching)
        assert [o.ids for o in out] == [r.ids for r in ref]
        assert eng.scheduler.num_preemptions > 0
        assert eng.kv_leaks() == [] and eng.pool.num_free == 16


def _hit_vs_miss(sm, tok, vocab: int, seed: int) -> tuple[Engine, int, int]:
    """Two prompts sharing a 37-token prefix, one after the other, without and with the prefix cache: equal
    tokens and log-probabilities. Returns the caching engine, the tokens it did not compute, the prompts' length."""
    shared = _prompts(vocab, [37], seed=seed)[0]
    a, b = shared + [5, 6, 7], shared + [9]
    miss, _, fed_miss = _generate(sm, tok, [a, b], [6, 6], chunk=256, prefix_caching=False, logprobs=3,
                                  one_by_one=True)
    hit, eng, fed_hit = _generate(sm, tok, [a, b], [6, 6], chunk=256, logprobs=3, one_by_one=True)
    for m, h in zip(miss, hit, strict=True):
        assert h.ids == m.ids
        torch.testing.assert_close(torch.tensor(h.logprobs), torch.tensor(m.logprobs), atol=1e-4, rtol=1e-4)
    return eng, sum(fed_miss) - sum(fed_hit), len(a) + len(b)


def test_prefix_hit_equals_miss_and_computes_fewer_tokens(loaded):
    sm = SlotModel(loaded.model, 4, 128, num_blocks=64, block_size=8)
    eng, saved, prompt_tokens = _hit_vs_miss(sm, loaded.tokenizer, loaded.model.config.vocab_size, seed=2)
    # b's first 4 blocks (32 tokens) came from a's: 38 - 32 prompt tokens computed instead of 38
    assert saved == 32
    assert eng.pool.hits == 32 and eng.pool.queries == prompt_tokens


def test_gemma3_sliding_layers_paged_equals_static(loaded):
    from tests.memfit.runtime.conftest import tiny_gemma3

    torch.manual_seed(0)
    model = tiny_gemma3(["sliding_attention", "full_attention"], window=8, head_dim=16, vocab_size=120,
                        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                        max_position_embeddings=128).eval()
    prompts = _prompts(120, [21, 6, 13], seed=3)
    mt = [12, 15, 9]
    static, _, _ = _generate(SlotModel(model, 3, 64), loaded.tokenizer, prompts, mt)
    paged, eng, _ = _generate(SlotModel(model, 3, 64, num_blocks=20, block_size=4), loaded.tokenizer, prompts, mt)
    assert [o.ids for o in paged] == [o.ids for o in static]
    assert eng.kv_leaks() == []


def test_phi3_paged_equals_static_and_hf(loaded):
    """Phi-3 on the packed engine (its fused projections split into views): paged greedy tokens equal the static
    engine's on the same (already split) model and HF's, computed before the split."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                       initializer_range=0.2, pad_token_id=0, bos_token_id=1,
                                       eos_token_id=2)).eval()
    prompts = _prompts(120, [21, 6, 13], seed=4)
    mt = [12, 15, 9]
    want = [hf_greedy(SimpleNamespace(model=model), p, m) for p, m in zip(prompts, mt, strict=True)]
    paged, eng, _ = _generate(SlotModel(model, 3, 64, num_blocks=20, block_size=4), loaded.tokenizer, prompts, mt)
    static, _, _ = _generate(SlotModel(model, 3, 64), loaded.tokenizer, prompts, mt)
    assert [o.ids for o in paged] == [o.ids for o in static] == want
    assert eng.kv_leaks() == []


@pytest.mark.parametrize("block_size", [1, 5])
def test_odd_block_sizes(loaded, block_size):
    V = loaded.model.config.vocab_size
    prompts = _prompts(V, [9, 14], seed=4)
    static, _, _ = _generate(SlotModel(loaded.model, 2, 40), loaded.tokenizer, prompts, [7, 7])
    paged, eng, _ = _generate(SlotModel(loaded.model, 2, 40, num_blocks=80 // block_size, block_size=block_size),
                              loaded.tokenizer, prompts, [7, 7])
    assert [o.ids for o in paged] == [o.ids for o in static]
    assert eng.kv_leaks() == []


def _sliding_gemma(window: int = 8):
    """4 sliding layers (window ``window``) and 2 full ones: 3 KV groups of 2 layers, 2 cache tensors."""
    from tests.memfit.runtime.conftest import tiny_gemma3

    torch.manual_seed(0)
    return tiny_gemma3(["sliding_attention", "sliding_attention", "full_attention"] * 2, window=window, head_dim=16,
                       vocab_size=120, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=1, max_position_embeddings=128).eval()


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_sliding_groups_free_blocks_behind_the_window_and_equal_static_and_hf(loaded, kernels):
    """Prompts longer than the window: the sliding groups give back their old blocks while the sequences run
    (peak blocks held below what whole sequences take), and the greedy tokens equal the static engine's and HF's."""
    model = _sliding_gemma()
    prompts = _prompts(120, [29, 6, 41], seed=5)
    mt = [14, 20, 9]
    want = [hf_greedy(SimpleNamespace(model=model), p, m) for p, m in zip(prompts, mt, strict=True)]
    sm = SlotModel(model, 3, 64, num_blocks=60, block_size=4, cpu_kernels=kernels, dense_kernel=kernels)
    assert len(sm.kv_groups) == 3 and sm.kv_groups.size == 2 and len({id(k) for k in sm.k_cache}) == 2
    assert (sm.stack is not None) == (kernels == "on")
    peak: list[int] = []
    out, eng, _ = _generate(sm, loaded.tokenizer, prompts, mt, used=peak)
    static, _, _ = _generate(SlotModel(model, 3, 64, cpu_kernels=kernels, dense_kernel=kernels), loaded.tokenizer,
                             prompts, mt)
    assert [o.ids for o in out] == [o.ids for o in static] == want
    whole = sum(3 * -(-(len(p) + m - 1) // 4) for p, m in zip(prompts, mt, strict=True))  # no dropping
    assert max(peak) < whole
    assert eng.kv_leaks() == [] and eng.pool.num_free == 60
    info = eng.kv_info()  # /health's kv
    assert (info["kv_groups"], info["layers_per_block"], info["sliding_windows"]) == (3, 2, [8])


def test_a_sequence_longer_than_the_pool_runs_when_its_sliding_groups_drop_blocks(loaded):
    """60 positions in blocks of 4: 15 blocks in each of 3 groups (45) without dropping; the pool has 27. The full
    group holds 15, each sliding one at most blocks_for(8 - 1 + 7) + 1 = 5."""
    model = _sliding_gemma()
    prompt = _prompts(120, [40], seed=6)[0]
    sm = SlotModel(model, 1, 64, num_blocks=27, block_size=4)
    out, eng, _ = _generate(sm, loaded.tokenizer, [prompt], [20])
    assert out[0].ids == hf_greedy(SimpleNamespace(model=model), prompt, 20)
    assert eng.kv_leaks() == []


def test_sliding_prefix_hit_and_preemption_equal_a_miss(loaded):
    """A shared 37-token prefix (past the window): the second request reuses the full group's blocks and the
    sliding groups' blocks inside the window, and computes fewer tokens; a pool of one sequence preempts and
    resumes; the tokens are the same throughout."""
    model = _sliding_gemma()
    eng, saved, _ = _hit_vs_miss(SlotModel(model, 2, 64, num_blocks=80, block_size=4), loaded.tokenizer, 120, seed=7)
    assert saved == 36  # b found a's first 9 blocks: the full group's all, the sliding groups' last two
    assert eng.kv_leaks() == []
    prompts = _prompts(120, [20, 11, 26], seed=8)
    mt = [30, 25, 20]
    ref, _, _ = _generate(SlotModel(model, 3, 64), loaded.tokenizer, prompts, mt)
    small = SlotModel(model, 3, 64, num_blocks=28, block_size=4)  # one 50-position sequence, and a little
    out, eng, _ = _generate(small, loaded.tokenizer, prompts, mt)
    assert [o.ids for o in out] == [r.ids for r in ref]
    assert eng.scheduler.num_preemptions > 0 and eng.kv_leaks() == [] and eng.pool.num_free == 28


GEMMA = Path(__file__).resolve().parents[2] / ".cache" / "models" / "gemma3-270m"


@pytest.mark.slow
@pytest.mark.skipif(not (GEMMA / "config.json").is_file(), reason="make real-model not run")
def test_real_gemma3_long_prompt_in_a_pool_that_needs_the_window_dropped():
    """Gemma 3 270M (6 KV groups of 3 layers), a 1,400-token prompt in 256-token chunks: the pool holds exactly the
    blocks the sliding groups need (0.63x of the whole sequence's), and the greedy tokens equal the static
    engine's."""
    from memfit.hf import load_pretrained, load_tokenizer

    model = load_pretrained(str(GEMMA)).eval()
    tok = load_tokenizer(str(GEMMA))
    prompt = torch.randint(1000, 200000, (1400,), generator=torch.Generator().manual_seed(0)).tolist()
    static, _, _ = _generate(SlotModel(model, 1, 1424, dense_kernel="on", cpu_kernels="on"), tok, [prompt], [8],
                             chunk=256)
    model = load_pretrained(str(GEMMA)).eval()
    probe = SlotModel(model, 1, 1424, num_blocks=1, block_size=16)
    groups = probe.kv_groups
    assert len(groups) == 6 and groups.size == 3
    need = groups.blocks_held(1408, 16, 256)
    assert need == 88 + 5 * 49 < 6 * 88  # whole: 88 blocks in each group; a sliding one 512 - 1 + 256 positions
    del probe
    sm = SlotModel(model, 1, 1424, num_blocks=need, block_size=16, dense_kernel="on", cpu_kernels="on")
    paged, eng, _ = _generate(sm, tok, [prompt], [8], chunk=256)
    assert paged[0].ids == static[0].ids
    assert eng.kv_leaks() == []
