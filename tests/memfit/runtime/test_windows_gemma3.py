"""SlotModel on Gemma 3 (sandwich norms, q/k norms, scaled embeddings, GELU-tanh MLP, a RoPE base per layer type,
sliding and full layers) and on sliding windows (Mistral's, Qwen2's), against the HF model's own forward and
``generate``, with prompts longer than the window, chunked prefill and decodes of different lengths."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from memfit.runtime.attention import _window_mask
from memfit.runtime.slot_model import SlotModel

from .conftest import check_steps, tiny_gemma3

WINDOW = 8
_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               max_position_embeddings=128, initializer_range=0.2)


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gemma3":
        common = {k: v for k, v in _COMMON.items() if k != "num_hidden_layers"}
        return tiny_gemma3(["sliding_attention", "sliding_attention", "full_attention"], WINDOW, **common,
                           num_key_value_heads=1).eval()
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**_COMMON, num_key_value_heads=2, sliding_window=WINDOW)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**_COMMON, num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=1)).eval()


def test_window_mask_is_hfs_rule() -> None:
    m = _window_mask(torch.tensor([9]), 0, 10, 4)
    assert m[0].tolist() == [False] * 6 + [True] * 4  # query 9 sees keys 6..9


@pytest.mark.parametrize("kind", ["gemma3", "mistral", "qwen2"])
@pytest.mark.parametrize("kernels", ["off", "on"])
def test_prefill_and_decode_past_the_window_match_hf(kind: str, kernels: str) -> None:
    model = _model(kind)
    a, b = torch.randint(3, 300, (40,)), torch.randint(3, 300, (25,))
    with torch.no_grad():
        ref_a, ref_b = model(a[None]).logits[0], model(b[None]).logits[0]
    sm = SlotModel(model, 2, 64, dense_kernel=kernels, cpu_kernels=kernels)
    # the C++ layer loop runs them where the kernels are on: windows, sandwich and q/k norms, RoPE per layer type
    assert (sm.stack is not None) == (kernels == "on") and any(w == WINDOW for w in sm.windows)
    if kind == "gemma3":
        assert sm.sandwich == [True] * 3 and sm.rope.kinds == ["sliding_attention", "full_attention"]
        assert sm.windows == [WINDOW, WINDOW, None]
    # prefill chunks that start inside and past the window, a mixed step, then decodes of different lengths
    check_steps(sm, {0: a, 1: b}, {0: ref_a, 1: ref_b},
                [[(0, 0, 5, False), (1, 0, 12, True)], [(0, 5, 33, True)], [(0, 38, 1, True), (1, 12, 12, True)],
                 [(1, 24, 1, True), (0, 39, 1, True)]])


def test_gemma3_greedy_equals_hf_generate() -> None:
    from tests.serve.conftest import slot_greedy

    model = _model("gemma3")
    prompt = torch.randint(3, 300, (20,)).tolist()
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 20, dtype=torch.long),
                              max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)[0, 20:].tolist()
    assert slot_greedy(SlotModel(model, 1, 64, dense_kernel="on", cpu_kernels="on"), prompt, 16) == want
