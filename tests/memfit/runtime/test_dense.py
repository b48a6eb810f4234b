"""memfit.runtime.dense: fp32 CPU Linears on oneDNN's reordered weights or the kernels' panel layout give equal outputs
and the same greedy tokens."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.runtime import kernels
from memfit.runtime.dense import FusedSlice, OneDNNLinear, PanelLinear, available, pack_linears
from memfit.runtime.slot_model import Segment, SlotModel

pytestmark = pytest.mark.skipif(not available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_equals_f_linear(bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias)
    x = torch.randn(2, 5, 96, generator=g)
    ref = lin(x)
    with torch.no_grad():
        torch.testing.assert_close(OneDNNLinear(lin)(x), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(PanelLinear(lin, kernels.load("on"))(x), ref, atol=1e-5, rtol=1e-5)


def _model(tied: bool, vocab: int = 300) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def _greedy(sm: SlotModel, n: int = 12) -> list[int]:
    ids = torch.tensor([5, 17, 42, 99, 7])
    nxt = sm.forward(ids, [Segment(0, 0, len(ids))]).argmax(-1)
    out = [int(nxt)]
    for pos in range(len(ids), len(ids) + n - 1):
        nxt = sm.forward(nxt, [Segment(0, pos, 1)]).argmax(-1)
        out.append(int(nxt))
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("panel", [False, True])
def test_packed_model_serves_the_same_tokens(tied: bool, panel: bool) -> None:
    ref_model, model = _model(tied), _model(tied)
    ref = SlotModel(ref_model, 1, 32, dense_kernel="off")
    sm = SlotModel(model, 1, 32, dense_kernel="on", cpu_kernels="on" if panel else "off")
    kind = PanelLinear if panel else OneDNNLinear
    # 7 Linears per layer; an untied lm_head too; a tied one stays (the embedding needs the plain layout)
    assert sm.dense_packed == 2 * 7 + (0 if tied else 1)
    assert type(model.lm_head) is (nn.Linear if tied else kind)
    assert sm.lm_head is model.lm_head  # SlotModel calls the packed lm_head, not the replaced Linear
    layer = model.model.layers[0]
    assert type(layer.mlp.down_proj) is kind and type(layer.self_attn.o_proj) is kind
    assert type(sm.qkv[0]) is kind and type(sm.gate_up[0]) is kind
    # q/k/v and gate/up share one packed weight each, and SlotModel calls it once
    assert {type(getattr(layer.self_attn, n)) for n in ("q_proj", "k_proj", "v_proj")} == {FusedSlice}
    assert layer.self_attn.q_proj.fused is layer.self_attn.v_proj.fused is sm.qkv[0]
    assert layer.mlp.gate_proj.fused is sm.gate_up[0]
    assert (layer.self_attn.k_proj.start, layer.self_attn.k_proj.stop) == (64, 96)
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    torch.testing.assert_close(sm.forward(ids, [Segment(0, 0, 8)]), ref.forward(ids, [Segment(0, 0, 8)]),
                               atol=1e-4, rtol=1e-4)
    assert _greedy(sm) == _greedy(ref)
    with torch.no_grad():  # the HF forward runs through the replaced modules too
        torch.testing.assert_close(model(ids[None]).logits, ref_model(ids[None]).logits, atol=1e-4, rtol=1e-4)


def test_off_and_other_dtypes_are_left_alone() -> None:
    assert pack_linears(_model(False), "off") == 0
    assert pack_linears(_model(False).to(torch.bfloat16), "on") == 0
    with pytest.raises(ValueError, match="dense kernel mode"):
        pack_linears(_model(False), "fast")


def test_auto_packs_all_or_nothing_after_timing_both_kernels() -> None:
    model = _model(False)
    n = pack_linears(model, "auto")  # the choice depends on this CPU; either way every eligible Linear agrees
    assert n in (0, 2 * 7 + 1)
    kinds = {type(m) for m in model.modules() if isinstance(m, (nn.Linear, OneDNNLinear, FusedSlice))}
    assert kinds == ({OneDNNLinear, FusedSlice} if n else {nn.Linear})


def test_auto_with_the_kernels_packs_every_fp32_linear_without_timing(monkeypatch) -> None:
    from memfit.runtime import dense

    def timed(*a, **k):
        raise AssertionError("auto timed a Linear with memfit's kernels loaded")

    monkeypatch.setattr(dense, "_faster", timed)
    model = _model(False)
    assert pack_linears(model, "auto", kernels.load("on")) == 2 * 7 + 1
    assert {type(m) for m in model.modules() if isinstance(m, (nn.Linear, PanelLinear, FusedSlice))} == \
        {PanelLinear, FusedSlice}


@pytest.mark.parametrize("panel", [False, True])
def test_fused_projections_with_bias_equal_the_separate_linears(panel: bool) -> None:
    torch.manual_seed(0)
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = nn.Linear(48, 32), nn.Linear(48, 16), nn.Linear(48, 16)
    parent.gate_proj, parent.up_proj = nn.Linear(48, 40, bias=False), nn.Linear(48, 40)  # mixed bias: separate
    x = torch.randn(3, 48)
    with torch.no_grad():
        ref = {n: getattr(parent, n)(x) for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}
        assert pack_linears(parent, "on", kernels.load("on") if panel else None) == 5
        kind = PanelLinear if panel else OneDNNLinear
        assert type(parent.v_proj) is FusedSlice and type(parent.up_proj) is kind  # 40 outputs: padded panels
        assert type(parent.v_proj.fused) is kind
        for n, y in ref.items():
            torch.testing.assert_close(getattr(parent, n)(x), y, atol=1e-5, rtol=1e-5)


def _rss_file_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("panel", [False, True])
def test_packing_gives_back_the_page_cache_of_zero_copy_weights(tmp_path, panel: bool) -> None:
    from serve.loader import load

    torch.manual_seed(0)
    vocab = 16384  # with the kernels a tied vocabulary is packed as well (PanelEmbedding reads its rows)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    linear_kib = 4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 1024) * 4 // 1024  # 16.5 MiB of fp32 Linears
    vocab_kib = vocab * 256 * 4 // 1024  # 16 MiB
    shutil.copy(Path(__file__).parents[3] / "models" / "shakespeare-llama" / "tokenizer.json",
                tmp_path / "m")
    loaded = load(str(tmp_path / "m"))
    before = _rss_file_kib()
    sm = SlotModel(loaded.model, 1, 32, dense_kernel="on", cpu_kernels="on" if panel else "off")
    assert sm.dense_packed == 4 * 7
    assert sm.tied_vocab_packed is panel
    # reordering reads every weight; their file pages are dropped again, not left counted in RSS
    read_kib = linear_kib + (vocab_kib if panel else 0)
    assert _rss_file_kib() - before < read_kib // 4


def test_int8_dynamic_quantized_linears_run_on_the_int8_panel_kernel() -> None:
    import warnings

    from torch.ao.quantization import quantize_dynamic

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.model.layers = quantize_dynamic(model.model.layers, {nn.Linear}, dtype=torch.qint8)
    # the reference: the same model in fp32 with every weight replaced by its dequantized int8 codes
    ref_model = LlamaForCausalLM(cfg).eval()
    ref_model.load_state_dict({k: v for k, v in model.state_dict().items() if "_packed_params" not in k},
                              strict=False)
    for ly, ref_ly in zip(model.model.layers, ref_model.model.layers, strict=True):
        for part in ("self_attn", "mlp"):
            for name, child in getattr(ly, part).named_children():
                if hasattr(child, "weight") and callable(child.weight):
                    ref = getattr(getattr(ref_ly, part), name)
                    ref.weight.data.copy_(child.weight().dequantize())
    ids = torch.randint(3, 300, (20,))
    with torch.no_grad():
        want = ref_model(ids[None]).logits[0]
    sm = SlotModel(model, 1, 32, dense_kernel="on", cpu_kernels="on")
    layer = model.model.layers[0]
    assert type(layer.self_attn.o_proj) is PanelLinear and layer.self_attn.o_proj.scale is not None
    assert sm.stack is not None and sm.act_pairs == ["silu", "silu"]
    torch.testing.assert_close(sm.forward(ids, [Segment(0, 0, 20)])[0], want[-1], atol=1e-4, rtol=1e-4)
    stack, sm.stack = sm.stack, None  # the Python loop over the same modules
    torch.testing.assert_close(sm.forward(ids[:5], [Segment(0, 0, 5)])[0], want[4], atol=1e-4, rtol=1e-4)
    sm.stack = stack


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_bf16_weights_serve_the_bf16_rounded_model(tied: bool, source: torch.dtype) -> None:
    """bf16_weights: every Linear (and a tied lm_head with its embedding rows) on bf16 panels from an fp32 or a
    bf16 model; activations stay fp32, so the logits equal the fp32 engine over the bf16-rounded weights."""
    def rounded() -> LlamaForCausalLM:  # every weight a bf16 value: the same model in either source dtype
        m = _model(tied, 320)  # a tied table packs where the vocabulary is a multiple of 16
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(p.bfloat16().float())
        return m

    ref = SlotModel(rounded(), 1, 32, dense_kernel="on", cpu_kernels="on")
    model = rounded().to(source)
    sm = SlotModel(model, 1, 32, dense_kernel="on", cpu_kernels="on", bf16_weights=True)
    assert sm.dtype == torch.float32 and sm.k_cache[0].dtype == torch.float32
    assert type(model.lm_head) is PanelLinear and model.lm_head.format == "panel_bf16"
    assert type(model.model.embed_tokens).__name__ == ("PanelEmbedding" if tied else "Embedding")
    assert sm.qkv[0].format == sm.gate_up[0].format == "panel_bf16"
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.float32
    assert sm.stack is not None  # the C++ layer loop runs bf16 panels too
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2])  # 7 rows: fp32 activations in every Linear (below vdpbf16ps' 8)
    torch.testing.assert_close(sm.forward(ids, [Segment(0, 0, 7)]), ref.forward(ids, [Segment(0, 0, 7)]),
                               atol=1e-4, rtol=1e-4)
    assert _greedy(sm) == _greedy(ref)


def test_bf16_weights_need_the_kernels() -> None:
    from memfit.errors import UserError

    with pytest.raises(UserError, match="bf16 weights run on memfit's CPU kernels"):
        SlotModel(_model(False), 1, 32, dense_kernel="on", cpu_kernels="off", bf16_weights=True)


def test_bf16_weights_keep_an_unpackable_tied_table_tied() -> None:
    model = _model(True).to(torch.bfloat16)  # vocabulary 300: no 16-row panels for the tied table
    SlotModel(model, 1, 32, dense_kernel="on", cpu_kernels="on", bf16_weights=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("bf16", [False, True])
def test_packing_in_blocks_of_rows_equals_packing_at_once(monkeypatch, bf16: bool) -> None:
    """PanelLinear's drop_maps path (a file-backed table packed 16-row-aligned blocks at a time, each block's
    pages dropped) builds exactly the packing of the whole weight."""
    from memfit.runtime import dense

    ops = kernels.load("on")
    monkeypatch.setattr(dense, "PACK_BLOCK_ROWS", 48)  # three blocks and a partial one over 160 rows
    torch.manual_seed(0)
    lin = nn.Linear(64, 160, bias=False)
    whole = PanelLinear(lin, ops, bf16=bf16)
    blocks = PanelLinear(lin, ops, bf16=bf16, drop_maps=[])
    assert blocks.packed.dtype == whole.packed.dtype and torch.equal(blocks.packed, whole.packed)
    x = torch.randn(3, 64)
    torch.testing.assert_close(blocks(x), whole(x))
