"""memfit.runtime.embeddings: the lm_head and input embedding as int8 rows (and, serve's int4 at load, as 4-bit
groups) equal a model whose tables hold the dequantized values, on the HF forward and on SlotModel's kernels;
Gemma's embedding scale kept."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from memfit.errors import UserError
from memfit.runtime.embeddings import GroupEmbedding, Int8Embedding, PanelEmbedding, int8_rows, quantize_vocab_int8
from memfit.runtime.linear import weight_format
from memfit.runtime.slot_model import Segment, SlotModel

_COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)


def _model(kind: str, tied: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gemma3":
        return Gemma3ForCausalLM(Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=16,
                                                  query_pre_attn_scalar=16)).eval()
    return LlamaForCausalLM(LlamaConfig(**_COMMON, tie_word_embeddings=tied)).eval()


def _dequantized_reference(model: torch.nn.Module) -> torch.nn.Module:
    """The same model with its tables replaced by what int8 rows hold (codes * scale)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for t in {id(ref.lm_head.weight): ref.lm_head.weight, id(ref.get_input_embeddings().weight):
                  ref.get_input_embeddings().weight}.values():
            codes, scale = int8_rows(t)
            t.copy_(codes.float() * scale[:, None])
    return ref


def test_int8_rows_error_is_at_most_half_a_step() -> None:
    w = torch.randn(50, 33) * torch.logspace(-3, 1, 50)[:, None]
    w[7] = 0
    codes, scale = int8_rows(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127 and scale[7] == 1
    assert bool(((codes.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("kind,tied", [("llama", True), ("llama", False), ("gemma3", True)])
def test_int8_tables_equal_the_dequantized_model(kind: str, tied: bool) -> None:
    model = _model(kind, tied)
    ref = _dequantized_reference(model)
    sizes = quantize_vocab_int8(model)
    assert sizes["after_bytes"] < sizes["before_bytes"] / 3.5
    emb = model.get_input_embeddings()
    assert isinstance(emb, Int8Embedding) and weight_format(model.lm_head) == "int8_rows"
    assert (emb.codes is model.lm_head.codes) == tied  # tied tables share one set of codes
    ids = torch.randint(3, 320, (1, 30))
    with torch.no_grad():
        want = ref(ids).logits[0]
        torch.testing.assert_close(model(ids).logits[0], want, atol=1e-4, rtol=1e-4)
    # on the packed engine the lm_head runs on the int8 panel kernel
    sm = SlotModel(model, 1, 64, dense_kernel="on", cpu_kernels="on")
    assert weight_format(sm.lm_head) == "panel_int8"
    # tied: the embedding's rows come from the lm_head's packed table, one copy of the codes in all
    assert sm.tied_vocab_packed == tied and isinstance(model.get_input_embeddings(), PanelEmbedding) == tied
    out = sm.forward(ids[0], [Segment(0, 0, 30)])
    torch.testing.assert_close(out[0], want[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_tied_fp32_head_on_the_panel_kernel_reads_embeddings_from_it(kind: str) -> None:
    model = _model(kind)
    emb_before = model.get_input_embeddings()
    ids = torch.randint(0, 320, (1, 30))
    ids[0, :16] = torch.arange(304, 320)  # the last panel's rows
    with torch.no_grad():
        want_rows = emb_before(ids)
        want = model(ids).logits[0]
    sm = SlotModel(model, 1, 64, dense_kernel="on", cpu_kernels="on")
    assert sm.tied_vocab_packed and weight_format(sm.lm_head) == "panel_fp32"
    emb = model.get_input_embeddings()
    assert isinstance(emb, PanelEmbedding)
    torch.testing.assert_close(emb(ids), want_rows, atol=0, rtol=0)  # the same fp32 rows, Gemma's scale included
    out = sm.forward(ids[0], [Segment(0, 0, 30)])
    torch.testing.assert_close(out[0], want[-1], atol=1e-4, rtol=1e-4)
    # with the dense kernels off nothing is repacked
    other = _model(kind)
    assert not SlotModel(other, 1, 64, dense_kernel="off", cpu_kernels="on").tied_vocab_packed


def test_serve_loader_refuses_bad_values(tmp_path) -> None:
    from serve.loader import load

    with pytest.raises(UserError, match="--quantize-embeddings must be int8 or int4"):
        load(str(tmp_path), quantize_embeddings="int2")


@pytest.mark.parametrize("bits,sym,group,dim", [(4, False, 16, 64), (4, True, 64, 64), (3, False, 32, 64),
                                                (8, False, 64, 64), (4, False, 9, 63)])
def test_group_embedding_rows_equal_the_dequantized_table(bits: int, sym: bool, group: int, dim: int) -> None:
    from compress.quant import QuantArgs
    from compress.rtn import rtn

    w = torch.randn(50, dim) * torch.logspace(-2, 1, 50)[:, None]
    q = rtn(w, QuantArgs(bits, group, sym))
    ids = torch.tensor([[0, 49, 7, 7], [13, 2, 31, 48]])
    emb = GroupEmbedding(q, embed_scale=2.5)
    torch.testing.assert_close(emb(ids), q.dequantize()[ids] * 2.5, atol=0, rtol=0)
    if bits == 4:  # two codes a byte (an odd width: one)
        assert emb.codes.shape == (50, 32 if dim == 64 else 63) and emb.codes.dtype == torch.uint8


@pytest.mark.parametrize("kind,tied", [("llama", True), ("llama", False), ("gemma3", True)])
def test_int4_tables_at_load_equal_the_dequantized_model(kind: str, tied: bool) -> None:
    """serve --quantize-embeddings int4: lm_head on the int4 kernels, embedding rows 4-bit (Gemma's scale kept);
    against the model holding the dequantized tables, on the HF forward and on the packed engine."""
    from compress.quant import QuantArgs
    from compress.rtn import rtn
    from memfit.defaults import TABLE_GROUP_SIZE
    from serve.loader import quantize_vocab_int4

    model = _model(kind, tied)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for t in {id(ref.lm_head.weight): ref.lm_head.weight, id(ref.get_input_embeddings().weight):
                  ref.get_input_embeddings().weight}.values():
            t.copy_(rtn(t.detach().float(), QuantArgs(4, TABLE_GROUP_SIZE, False)).dequantize())
    sizes = quantize_vocab_int4(model)
    assert sizes["after_bytes"] < sizes["before_bytes"] * (0.36 if tied else 0.18)  # tied: two copies
    assert isinstance(model.get_input_embeddings(), GroupEmbedding)
    assert weight_format(model.lm_head) == "int4_cpu" and not model.config.tie_word_embeddings
    ids = torch.randint(3, 320, (1, 30))
    with torch.no_grad():
        want = ref(ids).logits[0]
        got = model(ids).logits[0]
    # the int4 pack keeps its scales and zeros in bf16 (and torch's op rounds activations to bf16)
    assert (got - want).abs().max() < 3e-2 * want.abs().max()
    sm = SlotModel(model, 1, 64, dense_kernel="on", cpu_kernels="on")  # the lm_head on memfit's int4 kernel
    assert sm.int4_kernel >= 1 and weight_format(sm.lm_head) == weight_format(model.lm_head) != "int4_cpu"
    out = sm.forward(ids[0], [Segment(0, 0, 30)])
    assert (out[0] - want[-1]).abs().max() < 3e-2 * want.abs().max()
