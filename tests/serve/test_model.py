"""SlotModel's forward against the HF model's own: RoPE variants (table and per-step paths), qwen3's q/k norms."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from serve.model import Segment, SlotModel

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
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16)).eval()
    return LlamaForCausalLM(LlamaConfig(**_COMMON, rope_parameters=_ROPE[kind])).eval()


@pytest.mark.parametrize("kind", ["default", "llama3", "dynamic", "qwen3"])
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
    # the C++ layer loop takes over where every layer is on the kernels (not qwen3's q/k norms, dynamic RoPE)
    assert (sm.stack is not None) == (kernels == "on" and dense == "on" and kind in ("default", "llama3"))
    assert sm._rope_static == (kind != "dynamic")
    # a prefill chunk of each, then a mixed step (decode of a, rest of b's prompt), then two decodes
    out = sm.forward(torch.cat([a[:38], b[:10]]), [Segment(0, 0, 38), Segment(1, 0, 10)])
    torch.testing.assert_close(out[0], ref_a[37], atol=1e-4, rtol=1e-4)
    out = sm.forward(torch.cat([a[38:39], b[10:24]]), [Segment(0, 38, 1), Segment(1, 10, 14)])
    torch.testing.assert_close(out[0], ref_a[38], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], ref_b[23], atol=1e-4, rtol=1e-4)
    out = sm.forward(torch.stack([b[24], a[39]]), [Segment(1, 24, 1), Segment(0, 39, 1)])
    torch.testing.assert_close(out[0], ref_b[24], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], ref_a[39], atol=1e-4, rtol=1e-4)


def test_rope_table_equals_the_rotary_module():
    model = _model("llama3")
    sm = SlotModel(model, 1, 64)
    h = torch.zeros(1, 5, 64)
    pos = torch.tensor([0, 7, 31, 40, 63])
    cos, sin = sm._rope(h, pos)
    rc, rs = model.model.rotary_emb(h, pos[None])
    torch.testing.assert_close(cos[:, 0], rc[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[:, 0], rs[0], atol=1e-6, rtol=0)
    assert cos.shape == (5, 1, 16)
