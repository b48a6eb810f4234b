"""Where AWQ may fold its per-channel scales, found from a decoder layer's structure, and the fold itself.

AWQ multiplies the input channels of a group of Linears by s and divides the op that produces that input by
s, so the float model is unchanged. Which op that is differs per architecture (Gemma 3's MLP input norm is
`pre_feedforward_layernorm`, its `post_attention_layernorm` normalizes the attention *output*; gpt_neox and
phi3 fuse q/k/v), so nothing here goes by model_type or by the Llama names:

- One traced forward of the layer (first calibration batch) groups the Linears by the tensor object they
  read, in call order. A group whose input is the very tensor a norm module returned folds into that norm.
  The norm's form is probed numerically: y = n(x) * w (+ b) ("norm": w, b /= s, Llama, LayerNorm) or
  y = n(x) * (1 + w) ("norm1p": Gemma, w' = (1 + w) / s - 1). For norm1p, w' is rounded to the fp16 the
  output stores first and the consumers get the scale that rounded weight really applies, (1 + w) / (1 + w'),
  so the fold stays exact after storage (w' near -1 keeps few significant bits in fp16).
- A group of one Linear folds into rows of the Linear that produces its input where that input is linear
  per channel in those rows: attention values -> output projection (v_proj, phi3's fused qkv_proj,
  gpt_neox's head-interleaved query_key_value -> o_proj/dense; with grouped-query attention one value
  channel feeds several output columns, which share its scale) and the up half of a gated MLP -> down_proj
  (down reads act(gate) * up, linear in up; Llama's SiLU, Gemma's GELU-tanh, phi3's fused gate_up_proj).
- Every candidate is then *checked*: folded with a random scale in [0.5, 2], the layer's output on the first
  batch must not move (relative to its residual update); otherwise the fold is dropped with a note and those
  Linears get AWQ's clipping search + RTN only. So a fold is never applied wrongly, whatever the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from compress.layerjob import LayerJob

STORE_DTYPE = torch.float16  # what walk.LayerWalk writes the non-quantized parameters (norms) as
CHECK_RTOL = 1e-3  # a verified fold moves the layer's output by less than this x its residual update
QK_NAMES = ("q_proj", "k_proj")  # rows feeding attention scores: never clipped (as AWQ does)
FUSED_QKV = ("qkv_proj", "query_key_value")  # q, k and v rows in one Linear (phi3, gpt_neox)


@dataclass
class Fold:
    """A group of Linears reading one input tensor and the op a per-channel scale of that input folds into."""

    consumers: list[str]
    """Every Linear reading the input (quantized or not), in call order; the first one is the stats tap."""
    kind: str | None = None
    """norm (x*w [+b]), norm1p (x*(1+w)), linear (rows of a Linear) or None (not folded: clipping only)."""
    prev: str | None = None
    """The module folded into (relative to the layer)."""
    rows: torch.Tensor | None = None
    """linear: the producer's output row of each scale channel (None: all rows, in order)."""
    expand: torch.Tensor | None = None
    """Consumer input column -> scale channel (grouped-query attention); None: one to one."""
    note: str | None = None
    """Why the group is not folded."""
    n_scale: int = 0
    """Scale channels."""

    @property
    def tap(self) -> str:
        return self.consumers[0]

    def describe(self) -> str:
        return f"{self.prev} -> {', '.join(self.consumers)}"


def _is_norm(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (not isinstance(m, nn.Linear | nn.Embedding) and not list(m.children())
            and isinstance(w, nn.Parameter) and w.dim() == 1)


def norm_kind(norm: nn.Module) -> str | None:
    """'norm' when the module's output is zero with weight (and bias) 0, 'norm1p' when with weight -1; else None."""
    w, b = norm.weight, getattr(norm, "bias", None)
    saved = [t.detach().clone() for t in (w, b) if isinstance(t, torch.Tensor)]
    x = torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)).to(w.dtype)
    try:
        with torch.no_grad():
            w.zero_()
            if isinstance(b, torch.Tensor):
                b.zero_()
            y0 = norm(x)
            w.fill_(-1.0)
            y1 = norm(x)
    except Exception:  # a module with a 1-D weight that is not a per-channel norm
        return None
    finally:
        with torch.no_grad():
            for t, v in zip([t for t in (w, b) if isinstance(t, torch.Tensor)], saved, strict=True):
                t.copy_(v)
    if not isinstance(y0, torch.Tensor) or y0.shape != x.shape:
        return None
    if y0.abs().max() == 0:
        return "norm"
    return "norm1p" if y1.abs().max() == 0 else None


def _trace(job: LayerJob) -> tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(Linear, the tensor it read) at each Linear's first call, and each norm's output, on the first batch."""
    calls: list[tuple[str, torch.Tensor]] = []
    outs: dict[str, torch.Tensor] = {}
    handles = []
    for n, m in job.layer.named_modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_pre_hook(
                lambda _m, a, n=n: calls.append((n, a[0])) if n not in {c for c, _ in calls} else None))
        elif _is_norm(m):
            handles.append(m.register_forward_hook(lambda _m, _a, out, n=n: outs.setdefault(n, out)))
    args, kwargs = job.inputs[0]
    try:
        with torch.no_grad():
            job.layer(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls, outs


def _heads(job: LayerJob) -> tuple[int, int, int]:
    cfg = job.config
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    return n_heads, n_kv, head_dim


def _value_rows(leaf: str, out_features: int, heads: tuple[int, int, int]) -> torch.Tensor | None:
    """The output rows holding the attention values in a (possibly fused) projection named leaf."""
    n_heads, n_kv, hd = heads
    if leaf == "v_proj" and out_features == n_kv * hd:
        return torch.arange(n_kv * hd)
    if leaf == "qkv_proj" and out_features == (n_heads + 2 * n_kv) * hd:  # phi3: [q | k | v]
        return (n_heads + n_kv) * hd + torch.arange(n_kv * hd)
    if leaf == "query_key_value" and out_features == 3 * n_heads * hd:  # gpt_neox: per head [q | k | v]
        j = torch.arange(n_heads * hd)
        return (j // hd) * 3 * hd + 2 * hd + j % hd
    return None


def _linear_candidates(job: LayerJob, consumer: str) -> list[Fold]:
    """Producer rows the single Linear `consumer` may fold into (values -> output projection, up -> down)."""
    parent, _, _ = consumer.rpartition(".")
    layer, heads = job.layer, _heads(job)
    c = layer.get_submodule(consumer)
    found = []
    for leaf in ("v_proj", "qkv_proj", "query_key_value", "up_proj", "gate_up_proj"):
        name = f"{parent}.{leaf}" if parent else leaf
        try:
            p = layer.get_submodule(name)
        except AttributeError:
            continue
        if not isinstance(p, nn.Linear) or name == consumer:
            continue
        rows = _value_rows(leaf, p.out_features, heads)
        if rows is not None:  # attention: output column -> value channel, shared across a GQA group
            n_heads, n_kv, hd = heads
            if c.in_features != n_heads * hd:
                continue
            o_in = torch.arange(n_heads * hd)
            expand = (o_in // hd) // (n_heads // n_kv) * hd + o_in % hd
            found.append(Fold([consumer], "linear", name, None if leaf == "v_proj" else rows, expand,
                              n_scale=n_kv * hd))
        elif leaf == "up_proj" and p.out_features == c.in_features:
            found.append(Fold([consumer], "linear", name, None, None, n_scale=c.in_features))
        elif leaf == "gate_up_proj" and p.out_features == 2 * c.in_features:  # phi3: [gate | up]
            found.append(Fold([consumer], "linear", name, c.in_features + torch.arange(c.in_features), None,
                              n_scale=c.in_features))
    return found


def apply(layer: nn.Module, f: Fold, s: torch.Tensor) -> torch.Tensor:
    """Fold 1/s into f.prev and s into f.consumers' input columns; returns the per-column scale applied."""
    mod = layer.get_submodule
    p = mod(f.prev)
    bias = getattr(p, "bias", None)
    with torch.no_grad():
        if f.kind == "norm":
            p.weight.div_(s.to(p.weight.dtype))
            if isinstance(bias, torch.Tensor):
                bias.div_(s.to(bias.dtype))
        elif f.kind == "norm1p":
            w = p.weight.float()
            m = 1 + w
            w_new = (m / s - 1).to(STORE_DTYPE).float()  # as stored; the consumers absorb its rounding
            bad = (1 + w_new == 0) | (m == 0)
            w_new = torch.where(bad, w, w_new)
            s = torch.where(bad, torch.ones_like(s), m / (1 + w_new))
            p.weight.copy_(w_new.to(p.weight.dtype))
            if isinstance(bias, torch.Tensor):
                bias.div_(s.to(bias.dtype))
        elif f.rows is None:
            p.weight.div_(s.unsqueeze(1).to(p.weight.dtype))
            if isinstance(bias, torch.Tensor):
                bias.div_(s.to(bias.dtype))
        else:
            p.weight[f.rows] = p.weight[f.rows] / s.unsqueeze(1).to(p.weight.dtype)
            if isinstance(bias, torch.Tensor):
                bias[f.rows] = bias[f.rows] / s.to(bias.dtype)
        sf = s if f.expand is None else s[f.expand]
        for c in f.consumers:
            mod(c).weight.mul_(sf.to(mod(c).weight.dtype))
    return sf


def _first_output(job: LayerJob) -> torch.Tensor:
    return LayerJob(job.layer, job.prefix, {}, {}, job.config, job.inputs[:1]).run()[0]


def _exact(job: LayerJob, f: Fold, ref: torch.Tensor, delta: float) -> bool:
    """Fold a random scale in [0.5, 2] in, run the first batch, restore: does the layer compute the same?"""
    mod = job.layer.get_submodule
    touched = [mod(f.prev).weight] + [mod(c).weight for c in f.consumers]
    bias = getattr(mod(f.prev), "bias", None)
    if isinstance(bias, torch.Tensor):
        touched.append(bias)
    saved = [t.detach().clone() for t in touched]
    g = torch.Generator().manual_seed(1)
    s = torch.exp((torch.rand(f.n_scale, generator=g) * 2 - 1) * math.log(2))
    try:
        apply(job.layer, f, s)
        out = _first_output(job)
    finally:
        with torch.no_grad():
            for t, v in zip(touched, saved, strict=True):
                t.copy_(v)
    err = float((out - ref).abs().max())
    return math.isfinite(err) and err <= CHECK_RTOL * delta + 1e-6 * float(ref.abs().max())


def plan(job: LayerJob) -> list[Fold]:
    """The layer's Linear groups in call order, each with its verified fold (or kind None and a note)."""
    calls, norm_out = _trace(job)
    groups: list[tuple[torch.Tensor, list[str]]] = []
    for name, x in calls:
        hit = next((g for g in groups if g[0] is x), None)
        if hit is None:
            groups.append((x, [name]))
        else:
            hit[1].append(name)
    ref = _first_output(job)
    delta = float((ref - job.inputs[0][0][0]).abs().max())
    folds = []
    for x, consumers in groups:
        src = next((n for n, out in norm_out.items() if out is x), None)
        if src is not None:
            kind = norm_kind(job.layer.get_submodule(src))
            cands = [Fold(consumers, kind, src, n_scale=x.shape[-1])] if kind else []
            why = f"{src} is not a per-channel norm (y = n(x) * w or n(x) * (1 + w))"
        elif len(consumers) == 1:
            cands = _linear_candidates(job, consumers[0])
            why = "its input is not linear per channel in a Linear's output rows (e.g. after an activation)"
        else:
            cands, why = [], "their input is produced by neither a norm nor a Linear"
        fold = next((c for c in cands if _exact(job, c, ref, delta)), None)
        if fold is None and cands:
            why = f"folding a scale into {cands[0].prev} changes the layer's output"
        folds.append(fold or Fold(consumers, note=f"{', '.join(consumers)}: not scaled ({why})"))
    return folds


def clip_rows(name: str, folds: list[Fold]) -> torch.Tensor | None:
    """Rows of Linear `name` AWQ's clipping search may touch (None: all): none for q/k (they feed attention
    scores), only the value rows of a fused q/k/v projection whose layout a verified fold confirmed."""
    leaf = name.rpartition(".")[2]
    if leaf in QK_NAMES:
        return torch.arange(0)
    if leaf in FUSED_QKV:
        return next((f.rows for f in folds if f.kind == "linear" and f.prev == name), torch.arange(0))
    return None
