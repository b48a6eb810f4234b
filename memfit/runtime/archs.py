"""GPT-2 and GPT-NeoX decoders under the Llama names SlotModel reads, so the packed engine runs them.

SlotModel walks a Llama-shaped tree: ``model.model.{layers, norm, rotary_emb}``, each layer's ``self_attn``
(``qkv_proj`` or q/k/v_proj, ``o_proj``), ``input_layernorm``, ``post_attention_layernorm`` and ``mlp``. These two
families name things differently and differ in four ways:

- **Fused q/k/v.** GPT-2's ``c_attn`` is a Conv1D (weights stored [in, out], columns [q | k | v]); GPT-NeoX's
  ``query_key_value`` holds each head's rows together ([q_h; k_h; v_h]). Both become one nn.Linear ``qkv_proj``
  with rows [q; k; v], the layout SlotModel slices: a copy, the original dropped. A quantized query_key_value
  (a compress output) runs as it is and its output columns are reordered.
- **Partial RoPE** (GPT-NeoX's rotary_pct, 0.25 in Pythia; Phi-3's partial_rotary_factor, 0.75 in Phi-4-mini,
  through ``permute_partial_rope``). The head dims of q and k get one permutation
  (q.k is unchanged): it puts the rotated dims where a full-width rotate_half pairs them, and the cos/sin table
  is padded with 1 / 0 for the rest. The full-width RoPE kernels then compute partial RoPE exactly.
- **GPT-2's learned positions.** There is no RoPE (an identity table); SlotModel adds the ``wpe`` rows.
- **GPT-NeoX's parallel residual**, h + attn(ln1(h)) + mlp(ln2(h)): SlotModel's ``parallel`` flag.

LayerNorms and the non-gated MLPs run as the HF modules on the Python loop (the C++ layer loop, fast_stack, runs
them itself). Containers and norms, which nothing replaces, get plain attribute aliases (not registered twice);
the Linears that packing replaces are registered under the new name.
After ``adapt`` the HF modules' own forward is not called again. ``check`` refuses, before anything changes,
what this cannot convert: a tensor-parallel query_key_value, offloaded GPT-2 Conv1Ds (a compress output's
quantized GPT-2 Linears run as they are), GPT-2 cross-attention or scale_attn_by_inverse_layer_idx. Those models
then run on the generic engine.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.errors import UserError
from memfit.runtime.linear import is_resident
from memfit.runtime.modules import tp_shards

ADAPTED_TYPES = {"gpt2", "gpt_neox"}


class UnsupportedModel(UserError):
    """A model the packed engine does not run (an architecture or a feature of one): the generic engine
    (generic.py) runs it instead."""


def check(hf_model: nn.Module) -> None:
    """Raise UnsupportedModel where ``adapt`` cannot convert the model; changes nothing."""
    cfg = hf_model.config
    mt = cfg.model_type
    if mt == "gpt2":
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "add_cross_attention", False):
            raise UnsupportedModel("model: gpt2 with per-layer attention scaling or cross-attention is not "
                                   "supported by the packed engine")
        from transformers.pytorch_utils import Conv1D

        blocks = hf_model.transformer.h
        convs = [m for b in blocks for m in (b.attn.c_attn, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]
        if any(isinstance(m, Conv1D) and not is_resident(m) for m in convs):  # others: a compress output's Linears
            raise UnsupportedModel("model: gpt2 with offloaded or sharded projections is not supported by the "
                                   "packed engine")
    elif mt == "gpt_neox":
        layers = hf_model.gpt_neox.layers
        if any(tp_shards(ly.attention.query_key_value) != 1 for ly in layers):
            raise UnsupportedModel("model: gpt_neox with a tensor-parallel query_key_value is not supported by the "
                                   "packed engine")
        attn = layers[0].attention
        if attn.rotary_ndims % 2 or not 0 < attn.rotary_ndims <= attn.head_size:
            raise UnsupportedModel(f"model: gpt_neox with {attn.rotary_ndims} rotary dims of {attn.head_size} is "
                                   "not supported by the packed engine")


def adapt(hf_model: nn.Module) -> None:
    """Give a GPT-2 / GPT-NeoX model the Llama names and layouts (after ``check``); other models are left as they
    are."""
    mt = hf_model.config.model_type
    if mt == "gpt2":
        _adapt_gpt2(hf_model)
    elif mt == "gpt_neox":
        _adapt_gpt_neox(hf_model)


def position_embedding(hf_model: nn.Module) -> nn.Embedding | None:
    """GPT-2's learned position table (added to the token embedding), or None."""
    return hf_model.transformer.wpe if hf_model.config.model_type == "gpt2" else None


def _alias(module: nn.Module, name: str, target: object) -> None:
    object.__setattr__(module, name, target)  # a plain attribute: not a second registration of the submodule


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().contiguous(), requires_grad=False)
    return lin


def _from_conv1d(conv: nn.Module) -> nn.Module:
    """A Conv1D (x @ W + b, W [in, out]) as an nn.Linear; a compress output's quantized Linear as it is."""
    from transformers.pytorch_utils import Conv1D

    return _linear(conv.weight.t(), conv.bias) if isinstance(conv, Conv1D) else conv


def _adapt_gpt2(hf_model: nn.Module) -> None:
    t = hf_model.transformer
    _alias(hf_model, "model", t)
    _alias(t, "layers", t.h)
    _alias(t, "norm", t.ln_f)
    _alias(t, "rotary_emb", NoRope(hf_model.config.hidden_size // hf_model.config.num_attention_heads))
    for b in t.h:
        _alias(b, "self_attn", b.attn)
        _alias(b, "input_layernorm", b.ln_1)
        _alias(b, "post_attention_layernorm", b.ln_2)
        b.attn.qkv_proj = _from_conv1d(b.attn.c_attn)
        b.attn.o_proj = _from_conv1d(b.attn.c_proj)
        del b.attn.c_attn, b.attn.c_proj
        b.mlp.c_fc = _from_conv1d(b.mlp.c_fc)
        b.mlp.c_proj = _from_conv1d(b.mlp.c_proj)


def rope_permutation(head_dim: int, rotary: int) -> torch.Tensor:
    """Index of the original head dim at each new position: partial rotate_half pairs (i, rotary/2 + i) for i <
    rotary/2; the full-width one pairs (i, head_dim/2 + i), so the rotated dims move there and the others fill in."""
    half, rh = head_dim // 2, rotary // 2
    rest = torch.arange(rotary, head_dim)
    return torch.cat([torch.arange(rh), rest[:half - rh], torch.arange(rh, rotary), rest[half - rh:]])


def _adapt_gpt_neox(hf_model: nn.Module) -> None:
    g = hf_model.gpt_neox
    _alias(hf_model, "model", g)
    _alias(g, "norm", g.final_layer_norm)
    attn0 = g.layers[0].attention
    D, r = attn0.head_size, attn0.rotary_ndims
    perm = rope_permutation(D, r)
    if r < D:
        g.rotary_emb = PaddedRope(g.rotary_emb, D)
    # output column of query_key_value for each column of [q; k; v]: head h's rows are [q_h; k_h; v_h]
    heads = torch.arange(hf_model.config.num_attention_heads)[:, None] * 3 * D
    order = torch.cat([(heads + part * D + dims).reshape(-1) for part, dims in ((0, perm), (1, perm),
                                                                              (2, torch.arange(D)))])
    for ly in g.layers:
        a = ly.attention
        _alias(ly, "self_attn", a)
        qkv = a.query_key_value
        if type(qkv) is nn.Linear and is_resident(qkv):  # rows reordered once
            bias = None if qkv.bias is None else qkv.bias.detach()[order]
            a.qkv_proj = _linear(qkv.weight.detach()[order], bias)
        else:  # a compress output's (or an offloaded) projection runs as it is; its output columns are reordered
            a.qkv_proj = ReorderedOutput(qkv, order)
        a.o_proj = a.dense
        del a.query_key_value, a.dense


def rotary_dims(rotary: nn.Module) -> int:
    """How many head dims the rotary module's cos/sin cover (all of them unless the RoPE is partial)."""
    buf = next(iter(rotary.buffers()), None)
    dev = buf.device if buf is not None and not buf.is_meta else torch.device("cpu")
    cos, _ = rotary(torch.zeros(1, device=dev), torch.zeros(1, 1, dtype=torch.long, device=dev))
    return int(cos.shape[-1])


def permute_partial_rope(model: nn.Module, layers: list[nn.Module], heads: int, kv_heads: int,
                         head_dim: int) -> None:
    """A Llama-layout model (Phi-3 after split_fused_projections) with partial RoPE: its q and k rows permuted
    per head (rope_permutation) and its rotary module padded, so full-width RoPE computes it. A fused qkv_proj
    left unsplit, or a quantized q/k_proj, keeps its weights and reorders its output columns instead."""
    rot = rotary_dims(model.model.rotary_emb)
    if rot == head_dim:
        return
    perm = rope_permutation(head_dim, rot)

    def cols(n: int, start: int = 0) -> torch.Tensor:
        return start + (torch.arange(n)[:, None] * head_dim + perm).reshape(-1)

    for ly in layers:
        a = ly.self_attn
        if hasattr(a, "qkv_proj"):
            v = torch.arange((heads + kv_heads) * head_dim, (heads + 2 * kv_heads) * head_dim)
            a.qkv_proj = ReorderedOutput(a.qkv_proj, torch.cat([cols(heads), cols(kv_heads, heads * head_dim), v]))
            continue
        for name, n in (("q_proj", heads), ("k_proj", kv_heads)):
            lin = getattr(a, name)
            order = cols(n)
            if type(lin) is nn.Linear and is_resident(lin):
                setattr(a, name, _linear(lin.weight.detach()[order], None if lin.bias is None else lin.bias[order]))
            else:
                setattr(a, name, ReorderedOutput(lin, order))
    model.model.rotary_emb = PaddedRope(model.model.rotary_emb, head_dim)


class ReorderedOutput(nn.Module):
    """``linear(x)[..., order]``: a fused projection whose weights stay as they are (a quantized format)."""

    def __init__(self, linear: nn.Module, order: torch.Tensor):
        super().__init__()
        self.linear = linear
        self.register_buffer("order", order, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).index_select(-1, self.order.to(x.device))


class NoRope(nn.Module):
    """An identity RoPE table (cos 1, sin 0) for models with learned positions: the RoPE kernels leave q, k as
    they are."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape, self.head_dim)
        return x.new_ones(shape), x.new_zeros(shape)


class PaddedRope(nn.Module):
    """A partial rotary module's cos/sin ([..., rotary], halves [c; c]) widened to the head dim in the layout of
    ``rope_permutation``: [c, 1..., c, 1...] and [s, 0..., s, 0...]."""

    def __init__(self, rotary: nn.Module, head_dim: int):
        super().__init__()
        self.rotary = rotary
        self.head_dim = head_dim
        self.rope_type = getattr(rotary, "rope_type", "default")  # rope.Rope reads it (dynamic variants)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(x, position_ids)
        rh, pad = cos.shape[-1] // 2, (self.head_dim - cos.shape[-1]) // 2
        one, zero = cos.new_ones(*cos.shape[:-1], pad), sin.new_zeros(*sin.shape[:-1], pad)
        return (torch.cat([cos[..., :rh], one, cos[..., rh:], one], -1),
                torch.cat([sin[..., :rh], zero, sin[..., rh:], zero], -1))
