"""The C++ layer loop (fast_stack, csrc/stack.cpp) on Gemma 3 and qwen3: q/k norms, sandwich norms with an eps
each, a RoPE base per layer type, sliding windows, GELU-tanh gate/up pairs; fp32 panel and int4 weights. Its
logits against the Python loop's (1e-5) and HF's (1e-4) over prefill chunks, mixed steps and decodes past the
window (int4 weights on builds whose decode rows round x to int16: 5e-4, see _int4_atol)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from memfit.runtime.linear import INT4_GATE_UP_GELU, PANEL_GELU_PAIRS
from memfit.runtime.slot_model import Segment, SlotModel

from .conftest import int4_rounds_decode_x, tiny_gemma3

WINDOW = 8
_COMMON = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, initializer_range=0.2)
# prefill chunks starting inside and past the window (one of them with no logits wanted), a mixed step (a decode
# and a chunk), decodes of different lengths past the window
STEPS = [[(0, 0, 5, False), (1, 0, 12, True)], [(0, 5, 33, True)], [(0, 38, 1, True), (1, 12, 12, True)],
         [(1, 24, 1, True), (0, 39, 1, True)], [(1, 25, 1, True), (0, 40, 1, True)]]


def _model(kind: str, head_dim: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**_COMMON, num_hidden_layers=2, head_dim=head_dim)).eval()
    model = tiny_gemma3(["sliding_attention", "full_attention"] * 2, WINDOW, head_dim, **_COMMON)
    for i, layer in enumerate(model.model.layers):  # an eps per norm, not one for the model
        layer.post_feedforward_layernorm.eps = 10.0 ** -(2 + i)
        layer.self_attn.k_norm.eps = 1e-3
    return model.eval()


def _int4(model: torch.nn.Module) -> None:
    from compress.quant import QuantArgs
    from compress.rtn import rtn
    from memfit.runtime.qlinear import quant_linear

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, quant_linear(rtn(child.weight.detach(), QuantArgs(4, 64, False)), None))


def _int4_atol(loops: float) -> float:
    """The tolerance of int4 models where decode-sized int4 calls (1-4 rows) round x to int16 per group
    (AVX512-VNNI builds): the two loops' x differ in the last bits (fp32 summation order), and a value near a
    rounding boundary then moves one int16 step (~1.5e-5 of its group's max); else ``loops``."""
    return 5e-4 if int4_rounds_decode_x() else loops


def _run(sm: SlotModel, seqs: dict) -> list[torch.Tensor]:
    outs = []
    for step in STEPS:
        ids = torch.cat([seqs[s][st:st + n] for s, st, n, _ in step])
        outs.append(sm.forward(ids, [Segment(s, st, n, w) for s, st, n, w in step]))
    return outs


@pytest.mark.parametrize("kind,weights,head_dim", [("gemma3", "fp32", 32), ("gemma3", "int4", 32),
                                                   ("gemma3", "fp32", 24), ("qwen3", "fp32", 32),
                                                   ("qwen3", "int4", 32)])
def test_stack_equals_the_python_loop_and_hf(kind: str, weights: str, head_dim: int) -> None:
    # head_dim 24: attention past prefill_attention's head dims (the stack's aten branch, windowed and not)
    model = _model(kind, head_dim)
    if weights == "int4":
        _int4(model)
    seqs = {0: torch.randint(3, 300, (41,)), 1: torch.randint(3, 300, (26,))}
    sm = SlotModel(model, 2, 64, dense_kernel="on", cpu_kernels="on")
    assert sm.stack is not None
    if kind == "gemma3":
        assert sm.sandwich == [True] * 4 and sm.act_pairs == ["gelu_tanh"] * 4
        assert sm.windows == [WINDOW, None, WINDOW, None]
        assert sm.rope.layer_kinds == ["sliding_attention", "full_attention"] * 2
        want_kind = INT4_GATE_UP_GELU if weights == "int4" else PANEL_GELU_PAIRS
        assert sm.gate_up[0].stack_spec(True, "gelu_tanh").kind == want_kind
    else:
        assert sm.act_pairs == ["silu"] * 2 and sm.rope.kinds == [None]
    stack, outs = sm.stack, {}
    for loop in ("cpp", "python"):
        sm.stack = stack if loop == "cpp" else None
        outs[loop] = _run(sm, seqs)
    sm.stack = stack
    loops_atol = _int4_atol(1e-5) if weights == "int4" else 1e-5
    for c, p in zip(outs["cpp"], outs["python"], strict=True):
        torch.testing.assert_close(c, p, atol=loops_atol, rtol=1e-5)
    # HF's forward over the same modules (packed or int4 on memfit's kernels: the weights SlotModel reads)
    with torch.no_grad():
        refs = {s: model(x[None]).logits[0] for s, x in seqs.items()}
    wanted = [(s, st + n - 1) for step in STEPS for s, st, n, w in step if w]
    got = [row for out in outs["cpp"] for row in out]
    assert len(got) == len(wanted)
    hf_atol = _int4_atol(1e-4) if weights == "int4" else 1e-4
    for row, (s, pos) in zip(got, wanted, strict=True):
        torch.testing.assert_close(row, refs[s][pos], atol=hf_atol, rtol=1e-4)


def test_stack_refuses_what_it_cannot_run() -> None:
    model = _model("gemma3")
    assert SlotModel(model, 2, 64, dense_kernel="off", cpu_kernels="on").stack is None  # nn.Linear projections
    model = _model("gemma3")
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()  # exact (erf) GELU: no epilogue for it
    sm = SlotModel(model, 2, 64, dense_kernel="on", cpu_kernels="on")
    assert sm.act_pairs[1] is None and sm.stack is None
    model = _model("gemma3")
    sm = SlotModel(model, 2, 64, dense_kernel="on", cpu_kernels="on", cache_dtype=torch.bfloat16)
    assert sm.stack is None


def test_bf16_weights_on_an_int4_model() -> None:
    """The engine's bf16 mode on a 4-bit model (serve --dtype auto on AVX512-BF16 CPUs): the int4 packs keep their
    bf16 scales, the int4 prefill rows run on vdpbf16ps, the stack runs, equal to the Python loop; close to fp32
    mode."""
    model, ref_model = _model("gemma3"), _model("gemma3")
    _int4(model)
    _int4(ref_model)
    seqs = {0: torch.randint(3, 300, (41,)), 1: torch.randint(3, 300, (26,))}
    ref = _run(SlotModel(ref_model, 2, 64, dense_kernel="on", cpu_kernels="on"), seqs)
    sm = SlotModel(model, 2, 64, dense_kernel="on", cpu_kernels="on", bf16_weights=True)
    assert sm.stack is not None and sm.bf16_dot and sm.gate_up[0].bf16_dot
    assert sm.gate_up[0].scale_zeros.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float32  # a tied table of 300 rows: no 16-row panels, stays fp32
    stack, outs = sm.stack, {}
    for loop in ("cpp", "python"):
        sm.stack = stack if loop == "cpp" else None
        outs[loop] = _run(sm, seqs)
    for c, p, r in zip(outs["cpp"], outs["python"], ref, strict=True):
        torch.testing.assert_close(c, p, atol=_int4_atol(1e-5), rtol=1e-5)
        assert (c - r).abs().max() < 0.02 * r.abs().max()  # bf16 rounding, not a different model
