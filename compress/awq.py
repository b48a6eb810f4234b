"""AWQ (Lin et al. 2023): activation-aware per-channel scaling plus weight clipping, then RTN.

For each op -> Linears pair (input RMSNorm -> q/k/v, v_proj -> o_proj, post-attention RMSNorm ->
gate/up, up_proj -> down_proj) the input channels are scaled by s = s_x**alpha, where s_x is the mean
|activation| per channel; alpha is searched on a 20-point grid in [0, 1) to minimise the error of the
quantized Linears' outputs on calibration tokens. The scale is folded into the previous op (its
weight divided by s), so the float model is unchanged. With grouped-query attention each v_proj
output channel feeds several o_proj input channels; they share one scale (an extension of AWQ, which
skips v->o when the shapes differ). Then, for every Linear but q/k, the per-group clipping range is
shrunk (down to 0.5x) where that lowers the output error. alpha = 0 and ratio 1 are plain RTN, so the
search never does worse than RTN on the calibration proxy.
"""

from __future__ import annotations

import torch

from compress.layerjob import LayerJob
from compress.quant import QuantArgs, Quantized
from compress.rtn import rtn
from memfit.errors import UserError

GRID = 20
SAMPLE_TOKENS = 4096  # tokens kept per Linear input for the scale search
CLIP_TOKENS = 512
LLAMA = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def fake_quant(w: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    return rtn(w, args).dequantize()


class InputStats:
    """Mean |x| per channel over all tokens plus a random sample of tokens."""

    def __init__(self, keep_per_batch: int, seed: int) -> None:
        self.abs_sum: torch.Tensor | None = None
        self.n = 0
        self.samples: list[torch.Tensor] = []
        self.keep = keep_per_batch
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        s = x.abs().sum(0)
        self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
        self.n += x.shape[0]
        idx = torch.randperm(x.shape[0], generator=self.gen)[: self.keep]
        self.samples.append(x[idx])

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / self.n

    @property
    def x(self) -> torch.Tensor:
        return torch.cat(self.samples)


def search_scale(x: torch.Tensor, x_mean: torch.Tensor, weights: list[torch.Tensor], args: list[QuantArgs],
                 expand: torch.Tensor | None = None) -> torch.Tensor:
    """Best s (one per scaled channel) for Linears reading x; expand maps input columns to scale index."""
    with torch.no_grad():
        ref = torch.cat([x @ w.t() for w in weights], dim=-1)
        best, best_s = float("inf"), torch.ones_like(x_mean)
        for i in range(GRID):
            alpha = i / GRID
            s = x_mean.clamp(min=1e-4).pow(alpha)
            s = s / (s.max() * s.min()).sqrt()
            sf = s if expand is None else s[expand]
            out = torch.cat([x @ (fake_quant(w * sf, a) / sf).t() for w, a in zip(weights, args, strict=True)], -1)
            err = (out - ref).pow(2).mean().item()
            if err < best:
                best, best_s = err, s
        return best_s


def search_clip(w: torch.Tensor, x: torch.Tensor, args: QuantArgs, max_shrink: float = 0.5) -> torch.Tensor:
    """w with each (row, group) clipped to the range that minimises that group's output error."""
    out, cols = w.shape
    g = args.group_size
    x = x[:CLIP_TOKENS].view(-1, cols // g, g)  # (t, ng, g)
    result = []
    for r0 in range(0, out, 256):
        wg = w[r0 : r0 + 256].view(-1, cols // g, g)
        ref = torch.einsum("ong,tng->ont", wg, x)
        amax = wg.abs().amax(-1, keepdim=True)
        best_err = torch.full(wg.shape[:2], float("inf"))
        best_max = amax.clone()
        for i in range(int(max_shrink * GRID)):
            cur_max = amax * (1 - i / GRID)
            wq = fake_quant(torch.clamp(wg, -cur_max, cur_max).view(-1, cols), args).view_as(wg)
            err = (torch.einsum("ong,tng->ont", wq, x) - ref).pow(2).mean(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better.unsqueeze(-1), cur_max, best_max)
        result.append(torch.clamp(wg, -best_max, best_max).view(-1, cols))
    return torch.cat(result)


def quantize_layer(job: LayerJob) -> dict[str, Quantized]:
    layer = job.layer
    names = set(job.linears)
    if not set(LLAMA) <= {n for n, _ in layer.named_modules()}:
        raise UserError("awq: only Llama-style decoder layers (self_attn.*_proj, mlp.*_proj) are supported; use gptq")
    keep = max(SAMPLE_TOKENS // max(len(job.inputs), 1), 1)
    taps = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
    stats = {n: InputStats(keep, seed=i) for i, n in enumerate(taps)}
    job.run({n: stats[n].add for n in taps})
    mod = layer.get_submodule
    cfg = job.config
    n_heads, n_kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    o_in = torch.arange(n_heads * head_dim)
    kv_of_o = (o_in // head_dim) // (n_heads // n_kv) * head_dim + o_in % head_dim  # o input col -> v output row
    plan = [  # (previous op, its kind, tap, consumers, expand)
        ("input_layernorm", "norm", "self_attn.q_proj",
         ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], None),
        ("self_attn.v_proj", "linear", "self_attn.o_proj", ["self_attn.o_proj"], kv_of_o),
        ("post_attention_layernorm", "norm", "mlp.gate_proj", ["mlp.gate_proj", "mlp.up_proj"], None),
        ("mlp.up_proj", "linear", "mlp.down_proj", ["mlp.down_proj"], None),
    ]
    x_in: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for prev, kind, tap, consumers, expand in plan:
            quantized = [c for c in consumers if c in names]
            x = stats[tap].x
            for c in consumers:
                x_in[c] = x
            if not quantized:
                continue
            mean = stats[tap].mean_abs
            if expand is not None:  # one scale per v_proj output channel: average its o_proj columns
                mean = torch.zeros(n_kv * head_dim).index_add_(0, expand, mean) / (n_heads // n_kv)
            s = search_scale(x, mean, [mod(c).weight.float() for c in quantized], [job.args[c] for c in quantized],
                             expand)
            sf = s if expand is None else s[expand]
            p = mod(prev)  # fold 1/s into the previous op; every reader of its output gets *s (exact in float)
            if kind == "norm":
                p.weight.div_(s.to(p.weight.dtype))
            else:
                p.weight.div_(s.unsqueeze(1).to(p.weight.dtype))
                if getattr(p, "bias", None) is not None:
                    p.bias.div_(s.to(p.bias.dtype))
            for c in consumers:
                mod(c).weight.mul_(sf.to(mod(c).weight.dtype))
                x_in[c] = x / sf
        results = {}
        for n, lin in job.linears.items():
            w = lin.weight.data.float()
            if n not in ("self_attn.q_proj", "self_attn.k_proj") and n in x_in:
                w = search_clip(w, x_in[n], job.args[n])
            results[n] = rtn(w, job.args[n])
            lin.weight.data = results[n].dequantize().to(lin.weight.dtype)
    return results
