"""A large vocabulary's tables as int8 rows: the lm_head (a Linear format) and the input embedding (row lookups);
and group-quantized (4-bit) embedding rows for a compress output.

Why: on Gemma 3 270M the tied 262,144 x 640 embedding is 168M of the model's 268M parameters, and a decode
step reads all of it as the lm_head: 671 MB in fp32, more than every decoder layer together. Stored as int8
codes with one fp32 scale per row (symmetric, W ~= codes * scale: the format torch's per-channel dynamic int8
uses), the lm_head reads a quarter of the bytes on memfit's int8 panel kernel (dense.PanelLinear packs it at
load) and the embedding looks up its rows from the same codes when the two are tied. The quality cost is
measured, not assumed (bench/embeddings.py reports KL to the fp32 model on held-out text).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit.runtime.quantized import Quantized

ROWS_PER_BLOCK = 4096  # int8_rows' working set: 4096 rows (10 MiB of fp32 for a 640-wide table)


def int8_rows(w: torch.Tensor, drop_maps: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K], scale fp32 [N]) with w ~= codes * scale[:, None]; a zero row gets scale 1.

    In blocks of rows: whole-table temporaries (|w|, w / scale, its rounding) of a 262k-row vocabulary were
    three fp32 copies of it, 2 GiB of load-time peak for Gemma 3 270M's 640 MiB table. ``drop_maps``
    (dense.file_maps()): ``w`` is read zero-copy from a safetensors file and replaced by the codes: each block's
    file pages are given back once quantized."""
    from memfit.runtime.dense import drop_file_pages

    w = w.detach()
    codes = torch.empty(w.shape, dtype=torch.int8)
    scale = torch.empty(w.shape[0], dtype=torch.float32)
    for i in range(0, w.shape[0], ROWS_PER_BLOCK):
        block = w[i:i + ROWS_PER_BLOCK].float()
        amax = block.abs().amax(dim=1)
        s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        codes[i:i + ROWS_PER_BLOCK] = torch.round(block / s[:, None]).clamp_(-127, 127)
        scale[i:i + ROWS_PER_BLOCK] = s
        if drop_maps is not None:
            drop_file_pages(w[i:i + ROWS_PER_BLOCK], drop_maps)
    return codes, scale


class Int8RowsLinear(nn.Module):
    """``y = x @ (codes * scale)^T + b``: this forward is the reference (it dequantizes on every call); with
    memfit's kernels ``dense.pack_linears`` replaces it by the int8 panel kernel over the same codes."""

    FORMAT = "int8_rows"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.codes.to(x.dtype) * self.scale[:, None].to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


class Int8Embedding(nn.Module):
    """Row lookups from int8 codes and per-row scales, times the model's own embedding scale where it has one
    (Gemma's sqrt(hidden)), in fp32."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, embed_scale: float | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale.float())
        self.embed_scale = embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.codes[ids].float() * self.scale[ids].unsqueeze(-1)
        return rows if self.embed_scale is None else rows * self.embed_scale


class GroupEmbedding(nn.Module):
    """Row lookups from group-quantized codes (a compress output's embedding, ``--quantize-embeddings int4``):
    W ~= (q - z) * s per (row, group); 4-bit codes two to a byte. Only the looked-up rows are dequantized."""

    def __init__(self, q: Quantized, embed_scale: float | None = None) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.codes.shape
        self.bits, self.group_size, self.embed_scale = q.bits, q.group_size, embed_scale
        codes = q.codes.to(torch.uint8)
        self.nibbles = q.bits == 4 and self.embedding_dim % 2 == 0
        if self.nibbles:  # low nibble: even column, high nibble: odd column
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scale", q.scale.float().contiguous())
        self.register_buffer("zero", q.zero.to(torch.uint8).contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        c = self.codes[ids]
        if self.nibbles:
            c = torch.stack([c & 15, c >> 4], dim=-1).flatten(-2)
        g = c.float().unflatten(-1, (-1, self.group_size))
        rows = ((g - self.zero[ids].float().unsqueeze(-1)) * self.scale[ids].unsqueeze(-1)).flatten(-2)
        return rows if self.embed_scale is None else rows * self.embed_scale


def int8_rows_of(q: Quantized) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A symmetric 8-bit, one-group-per-row ``Quantized`` as int8 rows (codes - 128, scale), or None."""
    if q.bits != 8 or not q.sym or q.group_size != q.codes.shape[1]:
        return None
    return (q.codes.to(torch.int16) - 128).to(torch.int8), q.scale[:, 0].float()


def quant_embedding(q: Quantized, embed_scale: float | None = None) -> nn.Module:
    """The input embedding for a quantized table: int8 rows where it is per-row symmetric 8-bit, else groups."""
    rows = int8_rows_of(q)
    return Int8Embedding(*rows, embed_scale) if rows is not None else GroupEmbedding(q, embed_scale)


def quantize_vocab_int8(model: nn.Module) -> dict[str, int]:
    """Replace the model's lm_head (and its input embedding) by int8 rows, sharing one set of codes when the two
    are tied. Returns the bytes of the tables before and after."""
    head = getattr(model, "lm_head", None)
    emb = model.get_input_embeddings()
    if type(head) is not nn.Linear or not isinstance(emb, nn.Embedding):
        raise ValueError("quantize_vocab_int8: the model has no plain nn.Linear lm_head and nn.Embedding input")
    tied = head.weight.data_ptr() == emb.weight.data_ptr()
    before = head.weight.numel() * head.weight.element_size() * (1 if tied else 2)
    from memfit.runtime.dense import file_maps

    maps = file_maps()  # the fp32 tables are replaced: their file pages go as they are quantized
    codes, scale = int8_rows(head.weight, maps)
    model.lm_head = Int8RowsLinear(codes, scale, head.bias)
    if not tied:
        codes_e, scale_e = int8_rows(emb.weight, maps)
    else:
        codes_e, scale_e = codes, scale
    model.set_input_embeddings(Int8Embedding(codes_e, scale_e, embed_scale(emb)))
    model.config.tie_word_embeddings = False  # nothing to tie any more: the codes are shared directly
    after = codes.numel() + scale.numel() * 4 + (0 if tied else codes_e.numel() + scale_e.numel() * 4)
    return {"before_bytes": before, "after_bytes": after}


class PanelEmbedding(nn.Module):
    """Input embedding rows read from a tied lm_head's panel layout (dense.PanelLinear: W[p * 16 + j, k] at
    packed[p, k, j]; bf16 at packed[p, k // 2, 2 j + k % 2]), fp32, bf16 or int8 with its per-row scale: the
    vocabulary table is held once, in the layout the lm_head streams, instead of a second copy in the plain
    layout for the lookups."""

    def __init__(self, panel: nn.Module, embed_scale: float | None = None) -> None:
        super().__init__()
        self.panel, self.embed_scale = panel, embed_scale
        self.num_embeddings, self.embedding_dim = panel.out_features, panel.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        packed, scale = self.panel.packed, self.panel.scale
        p, j = torch.div(ids, 16, rounding_mode="floor"), ids % 16
        if packed.dtype == torch.bfloat16:  # [N / 16, K / 2, 16, 2]: a row is its 16-wide lane's K / 2 pairs
            rows = packed.view(packed.shape[0], packed.shape[1], 16, 2)[p, :, j].flatten(-2)
        else:
            rows = packed[p, :, j]
        rows = rows.float() if scale is None else rows.float() * scale[ids].unsqueeze(-1)
        return rows if self.embed_scale is None else rows * self.embed_scale


def embed_scale(emb: nn.Module) -> float | None:
    """The constant a scaled embedding multiplies its rows by (Gemma's sqrt(hidden)), or None."""
    es = getattr(emb, "scalar_embed_scale", None)  # Gemma3TextScaledWordEmbedding
    if es is None and isinstance(getattr(emb, "embed_scale", None), (float, int, torch.Tensor)):
        es = float(emb.embed_scale)
    return es


def pack_tied_vocab(model: nn.Module, ops, bf16: bool = False) -> bool:
    """Put a tied lm_head (fp32, or int8 rows sharing the embedding's codes; with ``bf16`` an fp32 or bf16 one
    stored in bf16) on memfit's panel kernel and read the input embedding's rows from the same packed table;
    True where done.

    Why: a tied head cannot be packed like the other Linears (the embedding needs the plain layout), so it ran
    on MKL's sgemv: on Gemma 3 270M that was ~110 of a decode step's ~115 ms (torch profiler, batch 1)."""
    from memfit.runtime.dense import PanelLinear, file_maps
    from memfit.runtime.linear import is_resident

    head, emb = getattr(model, "lm_head", None), model.get_input_embeddings()
    if ops is None or head is None or emb is None or getattr(head, "bias", None) is not None or \
            not is_resident(head) or not is_resident(emb):  # offloaded or tensor-parallel (DTensor) tables stay
        return False
    if type(head) is nn.Linear and isinstance(emb, nn.Embedding):
        w = getattr(head, "weight", None)
        if w is None or w.dtype not in ((torch.float32, torch.bfloat16) if bf16 else (torch.float32,)) or \
                w.device.type != "cpu" or w.is_meta or \
                getattr(emb, "weight", None) is None or w.data_ptr() != emb.weight.data_ptr():
            return False
    elif isinstance(head, Int8RowsLinear) and isinstance(emb, Int8Embedding):
        if head.codes.data_ptr() != emb.codes.data_ptr() or head.codes.device.type != "cpu":
            return False
    else:
        return False
    if head.out_features % 16:
        return False  # padded panels would need the lookups to skip the padding: not worth it for odd sizes
    # read zero-copy from the checkpoint, a float table's page-cache pages would stay in RSS (640 MiB on Gemma 3
    # 270M): they are given back block by block as the table is packed
    plain = type(head) is nn.Linear
    panel = PanelLinear(head, ops, bf16=bf16, drop_maps=file_maps() if plain else None)
    model.lm_head = panel
    model.set_input_embeddings(PanelEmbedding(panel, embed_scale(emb)))
    return True
