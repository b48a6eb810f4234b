"""SlotModel's forward against the HF model's own: RoPE variants (table and per-step paths), qwen3's q/k norms,
Phi-3's fused projections (with and without a sliding window shorter than the prompts), GPT-2 (Conv1D, learned
positions) and GPT-NeoX (interleaved q/k/v rows, partial RoPE, parallel or sequential residual)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from memfit.runtime.slot_model import Segment, SlotModel

from .conftest import check_steps, int4_rounds_decode_x

_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
_ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":  # vocabulary 320: its tied lm_head on the panel kernel (a multiple of 16)
        cfg = transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                      initializer_range=0.2)
        return transformers.GPT2LMHeadModel(cfg).eval()
    if kind.startswith("gpt_neox"):  # default: RoPE on 4 of 16 head dims, parallel residual
        seq = dict(rotary_pct=1.0, use_parallel_residual=False) if kind == "gpt_neox-seq" else {}
        c = {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}
        return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**c, **seq)).eval()
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16)).eval()
    if kind.startswith("phi3"):  # longrope (Phi-3 128k): short factors up to 32 positions, long ones beyond
        # phi3-partial(-longrope): RoPE on 12 of 16 head dims (as Phi-4-mini: 0.75, longrope)
        partial = {"partial_rotary_factor": 0.75} if "partial" in kind else {}
        n = 6 if partial else 8
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(n)],
                "long_factor": [2.0 + i / 4 for i in range(n)], "original_max_position_embeddings": 32, **partial}
        if not kind.endswith("longrope"):
            rope = {"rope_type": "default", "rope_theta": 10000.0, **partial}
        return Phi3ForCausalLM(Phi3Config(**_COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                          sliding_window=16 if kind == "phi3-window" else None,
                                          rope_parameters=rope)).eval()
    return LlamaForCausalLM(LlamaConfig(**_COMMON, rope_parameters=_ROPE[kind])).eval()


@pytest.mark.parametrize("kind", ["default", "llama3", "dynamic", "qwen3", "phi3", "phi3-window", "phi3-longrope",
                                  "phi3-partial", "phi3-partial-longrope", "gpt2", "gpt_neox", "gpt_neox-seq"])
@pytest.mark.parametrize("dense", ["off", "on"])
@pytest.mark.parametrize("kernels", ["off", "on"])
def test_prefill_and_decode_match_hf(kind, dense, kernels):
    model = _model(kind)
    a, b = torch.randint(3, 300, (40,)), torch.randint(3, 300, (25,))
    with torch.no_grad():
        ref_a = model(a[None]).logits[0]
        ref_b = model(b[None]).logits[0]
    # packing replaces the modules: reference first
    sm = SlotModel(model, 2, 64, dense_kernel=dense, cpu_kernels=kernels)
    assert (sm.ops is not None) == (kernels == "on")
    # the C++ layer loop takes over where every layer is on the kernels (qwen3's q/k norms, GPT-2 and GPT-NeoX too;
    # not dynamic RoPE)
    static = kind not in ("dynamic", "phi3-longrope", "phi3-partial-longrope")  # RoPE by sequence length
    stackable = static
    assert (sm.stack is not None) == (kernels == "on" and dense == "on" and stackable)
    assert sm.rope.static == static
    # a prefill chunk of each, then a mixed step (decode of a, rest of b's prompt), then two decodes
    check_steps(sm, {0: a, 1: b}, {0: ref_a, 1: ref_b},
                [[(0, 0, 38, True), (1, 0, 10, True)], [(0, 38, 1, True), (1, 10, 14, True)],
                 [(1, 24, 1, True), (0, 39, 1, True)]])


def test_rope_table_equals_the_rotary_module():
    model = _model("llama3")
    sm = SlotModel(model, 1, 64)
    h = torch.zeros(1, 5, 64)
    pos = torch.tensor([0, 7, 31, 40, 63])
    cos, sin = sm.rope(h, pos)
    rc, rs = model.model.rotary_emb(h, pos[None])
    torch.testing.assert_close(cos[:, 0], rc[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], rs[0], atol=1e-6, rtol=0)
    assert cos.shape == (5, 1, 16)


def test_int4_model_on_the_cpp_layer_loop_equals_the_python_loop():
    from compress.quant import QuantArgs
    from compress.rtn import rtn
    from memfit.runtime.qlinear import quant_linear

    torch.manual_seed(0)
    cfg = dict(_COMMON, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(LlamaConfig(**cfg, rope_parameters=_ROPE["default"])).eval()
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, quant_linear(rtn(child.weight.detach(), QuantArgs(4, 64, False)), None))
    sm = SlotModel(model, 2, 64, dense_kernel="on", cpu_kernels="on")
    assert sm.stack is not None and sm.int4_kernel == 2 * 7  # every projection (the fused ones for the HF path)
    a, b = torch.randint(3, 300, (30,)), torch.randint(3, 300, (12,))
    steps = [(torch.cat([a[:20], b[:5]]), [Segment(0, 0, 20), Segment(1, 0, 5)]),
             (torch.cat([a[20:21], b[5:12]]), [Segment(0, 20, 1), Segment(1, 5, 7)]),
             (torch.stack([b[11], a[20]]), [Segment(1, 12, 1), Segment(0, 21, 1)])]
    stack, outs = sm.stack, {}
    for kind in ("cpp", "python"):
        sm.stack = stack if kind == "cpp" else None
        outs[kind] = [sm.forward(ids, segs) for ids, segs in steps]
    for c, p in zip(outs["cpp"], outs["python"], strict=True):
        torch.testing.assert_close(c, p, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # and the HF forward over the same (swapped) int4 modules
        ref = model(a[None, :22]).logits[0]
    # the last layer runs its o_proj and MLP on the 2 rows whose logits return: decode-sized int4 calls, which
    # round x to int16 per group on AVX512-VNNI builds (HF's 22-row calls do not)
    atol = 1e-3 if int4_rounds_decode_x() else 1e-4
    torch.testing.assert_close(outs["cpp"][0][0], ref[19], atol=atol, rtol=1e-4)


def test_hooks_on_embedding_and_lm_head_still_run():
    # SlotModel calls their forward directly only where no hook is registered
    model = _model("default")
    seen = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(("lm_head", tuple(out.shape))))
    model.model.embed_tokens.register_forward_pre_hook(lambda m, args: seen.append(("embed", tuple(args[0].shape))))
    sm = SlotModel(model, 2, 64)
    sm.forward(torch.tensor([5, 6, 7]), [Segment(0, 0, 3)])
    assert seen == [("embed", (1, 3)), ("lm_head", (1, 300))]
    plain = SlotModel(_model("default"), 2, 64)
    assert plain._lm_head == plain.lm_head.forward and plain._embed == plain.inner.embed_tokens.forward


def test_last_layer_runs_only_the_rows_whose_logits_are_returned():
    # every layer but the last sees all 15 tokens; the last one's MLP only the 2 segments' last tokens (the
    # K/V of every token is cached before that), and 1 row when no logits are wanted (an earlier prompt chunk)
    model = _model("default")
    rows = []
    for layer in model.model.layers:
        layer.mlp.down_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    sm = SlotModel(model, 2, 64)
    ids = torch.randint(3, 300, (15,))
    out = sm.forward(ids, [Segment(0, 0, 10), Segment(1, 0, 5)])
    assert rows == [15, 2] and out.shape == (2, 300)
    rows.clear()
    assert sm.forward(ids[:8], [Segment(0, 0, 8, want_logits=False)]).shape == (0, 300)
    assert rows == [8, 1]
    with torch.no_grad():  # and the logits are still the full model's
        ref = model(ids[None, :10]).logits[0, -1]
    torch.testing.assert_close(out[0], ref, atol=1e-4, rtol=1e-4)
