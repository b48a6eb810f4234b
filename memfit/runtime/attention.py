"""Attention of one decoder layer over the paged KV cache, for a step's decodes and prefill chunks (the Python
reference path of SlotModel; the C++ layer loop does the same in csrc/attention.cpp).

A layer's cache is ``[blocks, kv_heads, block_size, head_dim]`` and ``ix["table"]`` maps each slot's positions to
blocks (slot_model.py). memfit's kernels read through the table; elsewhere a paged cache's sequences are gathered
into contiguous ``[n, kv_heads, positions, head_dim]`` first (the static cache, one block per slot, is sliced).
An int8 cache holds each row (token, KV head) as int8 times a per-row fp32 scale (``quantize_rows``; the kernels
do the same, csrc/common.h: KvPages); the gathered rows are widened.

Decodes (1 token each) are attended as one padded batch, prefill chunks one by one. memfit's kernels run
where they apply (CPU, fp32); torch's SDPA everywhere else. Sliding-window layers (Gemma 2/3, Qwen2 windows)
attend to the last ``window`` positions only: HF's rule, key j is seen by query i when i - window < j <= i.
While no sequence of the step is past its window that is plain causal attention and the fast paths run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class StepLayout:
    """Where a step's tokens are: decodes and prefill chunks, as SlotModel._forward lays them out."""

    offsets: list[int]  # first token row of each segment
    pre: list  # (segment index, Segment) of the prefill chunks
    dec_idx: list[int]  # segment indices of the decodes
    dec_slots: list[int]
    dec_lens: list[int]  # positions each decode attends to (its position + 1)
    all_dec: bool  # every segment is a decode: token order == decode order
    contiguous: bool  # the decodes' slots are consecutive (a slice of the cache, no gather)
    dec_max: int  # the longest decode's length (0 without decodes): computed once a step, read by every layer
    paged: bool = False  # the cache has several blocks per slot (else block_table[s, 0] == s)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V rows [..., D] as int8 [..., D] and fp32 scales [...]: symmetric per row, scale = max|x| / 127."""
    amax = x.abs().amax(-1).float()
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(x.float() * inv[..., None]).to(torch.int8), amax / 127.0


def smooth_key_norms(norms: dict, layers, head_dim: int) -> int:
    """Fold a per-channel factor s out of each layer's k_norm weight and into its q_norm weight (``norms``: the
    fused (weight, eps) of SlotModel._norms, changed in place); the number of layers changed.

    Why: keys have outlier channels that one int8 scale per row quantizes coarsely, and q.k is unchanged by
    (q * s).(k / s). Where keys pass a per-head RMSNorm (Gemma 3, Qwen3) that norm's gain sets each channel's
    size, so s = |gain| needs no calibration data; RoPE mixes channels i and i + D/2, so each pair shares the
    larger of its two. Gemma 3 270M, 1024 held-out tokens, K and V fake-quantized per row: mean KL to fp32
    1.2e-2 -> 3.4e-3 (calibrated per-channel maxima: 4.5e-3). Models without q/k norms keep plain rows."""
    done = 0
    for layer in layers:
        attn = layer.self_attn
        q_spec = norms.get(id(getattr(attn, "q_norm", None)))
        k_spec = norms.get(id(getattr(attn, "k_norm", None)))
        if q_spec is None or k_spec is None or not q_spec[0].numel() == k_spec[0].numel() == head_dim:
            continue
        g = k_spec[0].abs()
        g = torch.maximum(g[:head_dim // 2], g[head_dim // 2:]).repeat(2)
        s = g.clamp_min(g.max() * 1e-2)
        s = s / s.pow(2).mean().sqrt()  # unit RMS: q and k keep their overall size
        norms[id(attn.q_norm)] = ((q_spec[0] * s).contiguous(), q_spec[1])
        norms[id(attn.k_norm)] = ((k_spec[0] / s).contiguous(), k_spec[1])
        done += 1
    return done


def _rows(cache: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, end: int,
          scale: torch.Tensor | None = None) -> torch.Tensor:
    """The cached positions [0, end) of the sequences in ``slots`` as [len(slots), KV, end, D], gathered through
    the block table (int8 rows times their ``scale``)."""
    bs = cache.shape[2]
    nb = -(-end // bs)
    blocks = table[slots, :nb]
    g = cache[blocks]  # [n, nb, KV, bs, D]
    if scale is not None:
        g = g.float() * scale[blocks][..., None]
    return g.transpose(1, 2).reshape(g.shape[0], g.shape[2], nb * bs, g.shape[4])[:, :, :end]


def prefix_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                         scale: float) -> torch.Tensor:
    """Attention of a later prefill chunk q [1, H, n, D] over its slot's keys [0, start + n): the cached prefix
    unmasked, the chunk itself causally. Two flash calls merged by their logsumexp (as vLLM's merge_attn_states)
    rather than one SDPA call with an [n, end] mask, because the mask and SDPA's float copy of it are a chunk's
    largest allocation (2.5 MB per layer at n=256, end=2048); the same as csrc/stack.cpp. GQA needs no repeat:
    the CPU flash kernel takes fewer key heads."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_a, lse_a = flash(q, k[:, :, :start], v[:, :, :start], scale=scale)
    o_b, lse_b = flash(q, k[:, :, start:], v[:, :, start:], is_causal=True, scale=scale)
    # softmax over both parts = the parts' outputs weighted by sigmoid(lse_a - lse_b) and its complement
    w = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    if q.dtype == torch.float32:
        return torch.lerp(o_b, o_a, w)
    return torch.lerp(o_b.float(), o_a.float(), w).to(q.dtype)


def _window_mask(q_pos: torch.Tensor, lo: int, hi: int, window: int) -> torch.Tensor:
    """[len(q_pos), hi - lo] bool: key positions lo..hi-1 that each query position sees under a sliding window."""
    j = torch.arange(lo, hi, device=q_pos.device)[None, :]
    i = q_pos[:, None]
    return (j <= i) & (j > i - window)


def _decodes(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ix: dict, lay: StepLayout, ops, scale: float,
             window: int | None, ks: torch.Tensor | None, vs: torch.Tensor | None) -> torch.Tensor:
    """[n decodes, H, D] attention outputs of the step's decodes."""
    H, KV = q.shape[1], kc.shape[1]
    qd = q if lay.all_dec else q[ix["dec_tok"]]
    dec_max = lay.dec_max
    windowed = window is not None and dec_max > window
    if ops is not None and not windowed:
        return ops.decode_attention(qd, kc, vc, ix["table"], ix["dec_slots"], ix["dec_len"], scale, k_scale=ks,
                                    v_scale=vs)
    lo = max(0, min(lay.dec_lens) - window) if windowed else 0  # keys before lo are outside every window
    if lay.paged or ks is not None:
        kd, vd = (_rows(c, ix["table"], ix["dec_slots"], dec_max, sc)[:, :, lo:] for c, sc in ((kc, ks), (vc, vs)))
    elif lay.contiguous:
        a = lay.dec_slots[0]
        kd, vd = kc[a:a + len(lay.dec_slots), :, lo:dec_max], vc[a:a + len(lay.dec_slots), :, lo:dec_max]
    else:
        kd, vd = kc[ix["dec_slots"], :, lo:dec_max], vc[ix["dec_slots"], :, lo:dec_max]
    if windowed:
        mask = _window_mask(ix["dec_len"] - 1, lo, dec_max, window)[:, None, None, :]
    else:
        mask = ix["dec_mask"]  # None when every decode attends to the same number of positions
    od = F.scaled_dot_product_attention(qd[:, :, None, :], kd.to(q.dtype), vd.to(q.dtype), attn_mask=mask,
                                        scale=scale, enable_gqa=KV != H)
    return od[:, :, 0, :]


def _chunk(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slot: int, start: int, scale: float,
           window: int | None, table: torch.Tensor | None = None, ks: torch.Tensor | None = None,
           vs: torch.Tensor | None = None) -> torch.Tensor:
    """[n, H, D] attention of one prefill chunk q [n, H, D] at positions start.. over its slot's cache (with
    ``table``: paged or int8, its rows gathered first)."""
    n, H = q.shape[0], q.shape[1]
    end = start + n
    if table is not None:
        slots = torch.tensor([slot], device=table.device)
        kc, vc, slot = _rows(kc, table, slots, end, ks), _rows(vc, table, slots, end, vs), 0
    gqa = kc.shape[1] != H
    qp = q.transpose(0, 1)[None]  # [1, H, n, D]
    if window is not None and end > window:
        lo = max(0, start - window + 1)
        kp, vp = kc[slot:slot + 1, :, lo:end].to(q.dtype), vc[slot:slot + 1, :, lo:end].to(q.dtype)
        mask = _window_mask(torch.arange(start, end, device=q.device), lo, end, window)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return op[0].transpose(0, 1)
    kp, vp = kc[slot:slot + 1, :, :end].to(q.dtype), vc[slot:slot + 1, :, :end].to(q.dtype)
    if start == 0:
        op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
    elif q.device.type == "cpu":
        op = prefix_attention_cpu(qp, kp, vp, start, scale)
    else:
        mask = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return op[0].transpose(0, 1)


def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ix: dict, lay: StepLayout, ops, scale: float,
           window: int | None = None, ks: torch.Tensor | None = None, vs: torch.Tensor | None = None) -> torch.Tensor:
    """Attention outputs [T, H, D] of a step's queries q [T, H, D] (RoPE applied, K/V already in the cache; ``ks``,
    ``vs``: an int8 cache's scales)."""
    T, H, D = q.shape
    if lay.dec_idx and lay.all_dec:
        return _decodes(q, kc, vc, ix, lay, ops, scale, window, ks, vs)
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    if lay.dec_idx:
        out[ix["dec_tok"]] = _decodes(q, kc, vc, ix, lay, ops, scale, window, ks, vs)
    ours: list[int] = []  # chunks for the kernels' prefill attention (as csrc/stack.cpp does)
    for i, s in lay.pre:
        a, n = lay.offsets[i], s.length
        end = s.start + n
        if ops is not None and ops.prefill_attention_fits(D, end) and (window is None or end <= window):
            ours += [a, n, s.slot, s.start]
            continue
        gather = lay.paged or ks is not None
        out[a:a + n] = _chunk(q[a:a + n], kc, vc, s.slot, s.start, scale, window, ix["table"] if gather else None,
                              ks, vs)
    if ours:
        ops.prefill_attention(q, kc, vc, ix["table"], out, ours, scale, k_scale=ks, v_scale=vs)
    return out
