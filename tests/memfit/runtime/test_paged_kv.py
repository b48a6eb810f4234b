"""SlotModel on a paged KV cache (blocks of a few positions, in shuffled physical order, spare blocks between):
the same logits as HF's forward on the C++ layer loop, the kernels' Python loop and the torch-ops loop, with
chunks and decodes that cross block boundaries, GQA, sliding windows, a prompt past the prefill kernel's key bound,
two sequences sharing their first blocks (what prefix caching does), and int8 KV."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.errors import UserError
from memfit.runtime.kv_groups import group_layers, layer_windows
from memfit.runtime.slot_model import Segment, SlotModel

from .conftest import check_steps, tiny_gemma3

_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               max_position_embeddings=2048, initializer_range=0.2)
BS = 4


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gemma3":  # sliding (window 8) and full layers, 1 KV head
        return tiny_gemma3(["sliding_attention", "sliding_attention", "full_attention"], 8, **_COMMON,
                           num_key_value_heads=1).eval()
    return LlamaForCausalLM(LlamaConfig(**_COMMON, num_hidden_layers=2, num_key_value_heads=2)).eval()


def _paged(model: torch.nn.Module, max_batch: int, max_seq_len: int, path: str, seed: int = 0,
           cache_dtype: torch.dtype | None = None) -> SlotModel:
    """A paged SlotModel whose slots own disjoint blocks in every KV group, in a shuffled order (5 spare blocks no
    slot names). ``path``: "cpp" (the C++ layer loop), "kernels" (the Python loop on memfit's kernels), "torch"
    (torch ops)."""
    per = -(-max_seq_len // BS)
    kernels = "off" if path == "torch" else "on"
    G = len(group_layers(layer_windows(model.config, max_seq_len)))
    sm = SlotModel(model, max_batch, max_seq_len, dense_kernel=kernels, cpu_kernels=kernels,
                   num_blocks=G * max_batch * per + 5, block_size=BS, cache_dtype=cache_dtype)
    assert sm.paged and sm.k_cache[0].shape[0] == G * max_batch * per + 5 and sm.k_cache[0].shape[2] == BS
    assert len(sm.kv_groups) == G
    if path == "kernels":
        sm.stack = None
    assert (sm.stack is not None) == (path == "cpp")
    perm = torch.randperm(sm.num_blocks, generator=torch.Generator().manual_seed(seed))
    sm.block_tables[:] = perm[:G * max_batch * per].view(G, max_batch, per)
    return sm


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("path", ["cpp", "kernels", "torch"])
def test_paged_prefill_and_decode_match_hf(kind: str, path: str) -> None:
    model = _model(kind)
    a, b = torch.randint(3, 300, (40,)), torch.randint(3, 300, (25,))
    with torch.no_grad():
        ref_a, ref_b = model(a[None]).logits[0], model(b[None]).logits[0]
    sm = _paged(model, 2, 64, path)
    # chunks starting mid-block and past gemma's window, a mixed step, decodes of different lengths
    check_steps(sm, {0: a, 1: b}, {0: ref_a, 1: ref_b},
                [[(0, 0, 5, False), (1, 0, 10, True)], [(0, 5, 33, True)], [(0, 38, 1, True), (1, 10, 14, True)],
                 [(1, 24, 1, True), (0, 39, 1, True)]])


@pytest.mark.parametrize("path", ["cpp", "torch"])
def test_a_shared_prefix_of_blocks_gives_the_same_logits(path: str) -> None:
    # slot 1 names slot 0's first 3 blocks (12 positions) and prefills only its own rest, as a prefix-cache hit
    model = _model("llama")
    prefix, tail = torch.randint(3, 300, (12,)), torch.randint(3, 300, (9,))
    full = torch.cat([prefix, tail])
    with torch.no_grad():
        ref = model(full[None]).logits[0]
    sm = _paged(model, 2, 32, path)
    sm.forward(torch.cat([prefix, tail[:2]]), [Segment(0, 0, 14)])  # slot 0: the whole prefix and 2 more
    sm.block_tables[:, 1, :3] = sm.block_tables[:, 0, :3]
    out = sm.forward(tail, [Segment(1, 12, 9)])
    torch.testing.assert_close(out[0], ref[-1], atol=1e-4, rtol=1e-4)


def test_a_chunk_past_the_prefill_kernels_key_bound_gathers_its_blocks() -> None:
    # 1,100 keys: the C++ loop's aten path (csrc/stack.cpp: seq_rows) over the blocks of a later chunk
    model = _model("llama")
    ids = torch.randint(3, 300, (1100,))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    sm = _paged(model, 1, 1104, "cpp")
    sm.forward(ids[:1000], [Segment(0, 0, 1000, want_logits=False)])
    out = sm.forward(ids[1000:], [Segment(0, 1000, 100)])
    torch.testing.assert_close(out[0], ref[-1], atol=1e-4, rtol=1e-4)


def test_static_cache_is_one_block_per_slot_and_bad_sizes_are_refused() -> None:
    sm = SlotModel(_model("llama"), 3, 40)
    assert not sm.paged and sm.block_size == 40 and sm.num_blocks == 3
    assert sm.block_table.tolist() == [[0], [1], [2]]
    assert sm.bytes_per_block == 2 * 2 * 2 * 40 * 16 * 4  # K and V, 2 layers, 2 KV heads, 40 positions, D 16, fp32
    with pytest.raises(UserError, match="both num_blocks and block_size"):
        SlotModel(_model("llama"), 1, 40, block_size=4)
    with pytest.raises(UserError, match="must be >= 1"):
        SlotModel(_model("llama"), 1, 40, block_size=4, num_blocks=0)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_int8_kv_is_close_to_fp32_and_the_same_on_every_path(kind: str) -> None:
    # int8 K/V (a scale per token and head): the three paths agree with each other, and with HF's fp32 logits
    # to the int8 error
    model = _model(kind)
    a, b = torch.randint(3, 300, (40,)), torch.randint(3, 300, (25,))
    with torch.no_grad():
        ref = {0: model(a[None]).logits[0], 1: model(b[None]).logits[0]}
    steps = [[(0, 0, 5, False), (1, 0, 10, True)], [(0, 5, 33, True)], [(0, 38, 1, True), (1, 10, 14, True)],
             [(1, 24, 1, True), (0, 39, 1, True)]]
    outs = {}
    for path in ("cpp", "kernels", "torch"):
        sm = _paged(model, 2, 64, path, cache_dtype=torch.int8)
        assert sm.kv_int8 and sm.k_cache[0].dtype == torch.int8
        # 1 byte per value plus a 4-byte scale per row of 16 values (this model's head_dim), in each cache
        # tensor (the layers of different KV groups share one)
        caches = {id(c): c for c in sm.k_cache}.values()
        assert len(caches) == sm.kv_groups.size
        assert sm.bytes_per_block == sum(2 * (c[0].numel() + 4 * c[0].numel() // c.shape[-1]) for c in caches)
        outs[path] = []
        seqs = {0: a, 1: b}
        for step in steps:
            ids = torch.cat([seqs[s][st:st + n] for s, st, n, _ in step])
            outs[path].append(sm.forward(ids, [Segment(s, st, n, w) for s, st, n, w in step]))
    for path in ("kernels", "torch"):
        for x, y in zip(outs["cpp"], outs[path], strict=True):
            torch.testing.assert_close(x, y, atol=2e-3, rtol=0)
    wanted = [(s, st + n - 1) for step in steps for s, st, n, w in step if w]
    got = torch.cat(outs["cpp"])
    want = torch.stack([ref[s][p] for s, p in wanted])
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kl) < 1e-3 and float((got - want).abs().max()) < 0.25  # logits of this random model: ~+-4
    assert float((got - want).abs().max()) > 0  # int8 is not exact: the test sees the quantized cache


def test_int8_keys_move_the_k_norm_outlier_channels_into_the_queries(monkeypatch) -> None:
    # Gemma-style keys with two loud channels (a RoPE pair) set by k_norm's gain: the fold keeps every q.k and
    # shrinks the int8 cache's error against the fp32 model; without the fold (the plain per-row scale) it is larger
    import memfit.runtime.slot_model as slot_model_mod
    from memfit.runtime.attention import smooth_key_norms
    from memfit.runtime.modules import rms_norm_weight

    model = _model("gemma3")
    D = model.config.head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight[[3, 3 + D // 2]] = 20.0
    norms = {id(m): spec for m in model.modules() if (spec := rms_norm_weight(m)) is not None}
    before = dict(norms)
    assert smooth_key_norms(norms, model.model.layers, D) == len(model.model.layers)
    q, k = torch.randn(5, D), torch.randn(7, D)
    for layer in model.model.layers:
        qn, kn = id(layer.self_attn.q_norm), id(layer.self_attn.k_norm)
        dots = [torch.nn.functional.rms_norm(q, (D,), n[qn][0], n[qn][1]) @
                torch.nn.functional.rms_norm(k, (D,), n[kn][0], n[kn][1]).T for n in (before, norms)]
        torch.testing.assert_close(dots[0], dots[1], rtol=1e-5, atol=1e-5)
        s = before[kn][0] / norms[kn][0]
        torch.testing.assert_close(s[:D // 2], s[D // 2:])  # RoPE pairs share a factor
        assert float(s[3]) > 5 * float(s.median())

    ids = torch.randint(3, 300, (48,))
    with torch.no_grad():
        want = model(ids[None]).logits[0].log_softmax(-1)

    def int8_kl() -> float:
        sm = _paged(model, 1, 64, "cpp", cache_dtype=torch.int8)
        got = sm.forward(ids, [Segment(0, p, 1) for p in range(len(ids))]).log_softmax(-1)
        return float(torch.nn.functional.kl_div(got, want, log_target=True, reduction="batchmean"))

    folded = int8_kl()
    monkeypatch.setattr(slot_model_mod, "smooth_key_norms", lambda *a: 0)
    plain = int8_kl()
    assert folded < 0.5 * plain, (folded, plain)
