"""fp32 ``nn.Linear`` on CPU through oneDNN, with each weight reordered once into oneDNN's blocked layout.

Why: at serving batch sizes (M = 1..16 rows) ``F.linear`` runs MKL's sgemm on the row-major weight, which
streamed ~10 GB/s of weights on the 2-core AVX-512 host of the serving benchmark (read bandwidth 31 GB/s).
oneDNN's inner product on a pre-reordered weight (`torch.ops.mkldnn._linear_pointwise`) was 1.1-2.4x
faster per call at M = 1..256 in an A/B of the same shapes. On the serving benchmark's 33.7M Llama, a whole
decode step with 2 threads was 1.48x faster at batch 1 and 1.23x at batch 16 (10.7 vs 15.8 ms, 24.2 vs
29.8 ms); with 1 thread only 1.04x. Because the gain depends on the CPU and the thread count, ``auto``
without memfit's kernels times both on the model's own largest Linear shape at load and packs only when
oneDNN wins; with them it always packs (the panel kernel, below; why in ``pack_linears``).
Results equal ``F.linear`` to fp32 rounding (max |diff| 2e-6 on that model's logits).

q/k/v and the MLP's gate/up of one layer are packed as one fused weight (their inputs are the same): one
call instead of three (two) was 1.8x (1.4x) faster at M = 1 and 1.4x (1.2x) at M = 16, equal at M = 256
(A/B on the serving benchmark's shapes, 2 threads; with MKL's sgemm fusing had been 4-11% slower at
M >= 4, which is why only int4 was fused before). The HF modules become ``FusedSlice`` views of the fused
call, so the model's own forward still works; ``memfit.runtime.fuse`` hands SlotModel the fused call itself.

Where memfit.runtime.kernels is built (``--cpu-kernels``), the Linears run on its panel kernel instead
(``PanelLinear``, weight as [N/16, K, 16]): it streams each weight once per call whatever the row count. On
the serving benchmark's 40 Linear shapes (10 layers, streamed from memory, 2 threads), median ms oneDNN vs
panel: M = 1 8.2 vs 5.2, M = 4 6.1 vs 4.3, M = 8 7.1 vs 4.4, M = 16 9.0 vs 7.0, M = 64 22.9 vs 21.6,
M = 256 86.5 vs 85.7 (both at ~176 GFLOPS, the 2 cores' fp32 peak).

The reordered weight replaces the original (no second copy; where the original was read zero-copy from a
safetensors mmap, its page-cache pages are given back too). Skipped: other dtypes, non-CPU, modules
with offload hooks or tensor-parallel shards, subclasses (bitsandbytes, compress), and weights shared
with another parameter (a tied lm_head: the embedding still needs the plain layout).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from memfit.runtime.linear import (
    ACTS,
    NONE,
    PAIR_KINDS,
    PANEL,
    StackSpec,
    is_resident,
    is_torch_int8,
    weight_format,
)

MODES = ("auto", "on", "off")
# The batch size oneDNN picks the weight's blocked layout for. Measured on the 2-core AVX-512 host, 2 threads,
# a 2816x512 weight streamed from memory: hint 1 (the first choice) ran M = 4 / 16 / 64 rows in 378 / 549 /
# 1124 us, any hint from 8 to 256 in 217-236 / 313-350 / 928-961 us; at M = 1 all hints 246-275 us.
REORDER_BATCH_HINT = 64


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


Weights = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


def _is_int8(m: nn.Module) -> bool:
    """int8 weights the panel kernel runs: torch's dynamic int8 Linear or memfit's int8 rows."""
    return is_torch_int8(m) or weight_format(m) == "int8_rows"


def _has_bias(m: nn.Module) -> bool:
    return (m.bias() if is_torch_int8(m) else m.bias) is not None


def _weights(m: nn.Module | Weights) -> Weights:
    """(weight [N, K], bias, per-output scale): fp32 and no scale for an ``nn.Linear``; int8 codes and their
    scales for a torch dynamic-quantized Linear (W = codes * scale)."""
    if isinstance(m, tuple):
        return m
    if weight_format(m) == "int8_rows":  # embeddings.Int8RowsLinear: W = codes * scale per row
        return m.codes, m.bias, m.scale
    if is_torch_int8(m):
        w, b = m.weight(), m.bias()
        if w.qscheme() == torch.per_tensor_affine:
            scale = torch.full((w.shape[0],), float(w.q_scale()))
        else:
            scale = w.q_per_channel_scales().float()
        return w.int_repr(), None if b is None else b.detach().float(), scale
    return m.weight.detach(), None if m.bias is None else m.bias.detach(), None


class OneDNNLinear(nn.Module):
    """``y = x @ W^T + b`` with W held in oneDNN's reordered layout (a non-persistent buffer)."""

    FORMAT = "onednn_fp32"

    def __init__(self, linear: nn.Linear | Weights) -> None:
        super().__init__()
        w, b, _ = _weights(linear)
        self.out_features, self.in_features = w.shape
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, REORDER_BATCH_HINT),
                             persistent=False)
        self.bias = None if b is None else nn.Parameter(b, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def stack_spec(self, gate_up: bool, act: str = "silu") -> StackSpec | None:
        return None  # the C++ layer loop runs memfit's own kernels only

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


PACK_BLOCK_ROWS = 4096  # rows packed per call by _pack_in_blocks (a multiple of the panels' 16)


def _pack_in_blocks(ops, w: torch.Tensor, dtype: torch.dtype, maps: list[tuple[int, int]]) -> torch.Tensor:
    """``ops.pack_panels(w)`` a block of rows at a time (a panel holds 16 whole rows, so the blocks' packings
    are the whole one's slices), dropping each block's file pages once packed."""
    first = ops.pack_panels(w[:PACK_BLOCK_ROWS].to(dtype).contiguous())
    if w.shape[0] <= PACK_BLOCK_ROWS:
        drop_file_pages(w, maps)
        return first
    out = first.new_empty((w.shape[0] // 16, *first.shape[1:]))
    out[:first.shape[0]] = first
    drop_file_pages(w[:PACK_BLOCK_ROWS], maps)
    for r in range(PACK_BLOCK_ROWS, w.shape[0], PACK_BLOCK_ROWS):
        block = w[r:r + PACK_BLOCK_ROWS]
        out[r // 16:(r + block.shape[0]) // 16] = ops.pack_panels(block.to(dtype).contiguous())
        drop_file_pages(block, maps)
    return out


class PanelLinear(nn.Module):
    """``y = x @ W^T + b`` on memfit.runtime.kernels' panel layout (``ops.pack_panels``; a non-persistent buffer). An
    output size that is not a multiple of 16 (a vocabulary) is padded with zero rows, sliced off each call.

    ``pairs``: a fused gate/up projection whose 16-row panels alternate gate and up rows of the same outputs,
    so ``act_mul(x, act)`` gets the MLP's ``act(gate) * up`` (SiLU or GELU-tanh) from the GEMM's epilogue (no
    [T, 2 n] intermediate, no separate activation and mul passes: 6.3 of a 256-token prefill step's 104 ms);
    ``forward`` still returns ``[gate | up]``.

    int8 weights (``serve --quantize int8``: torch's dynamic-quantized Linears) keep their codes and scales and
    run with fp32 activations (weight-only int8: the weight streams at a quarter of fp32's bytes; torch's own
    dynamic kernel also quantizes the activations and measured slower than this fp32 path).

    ``bf16``: a float weight is stored in bf16 (half of fp32's bytes; ``serve --dtype bf16``, and ``auto`` where
    the CPU has AVX512-BF16), in k pairs as vdpbf16ps reads them. Activations stay fp32: at few rows the
    weights are widened exactly to fp32 in registers (decode is bound by the bytes read, not by the FMAs); from
    8 rows on (prefill, large batches) x is rounded to bf16 and each pair is one vdpbf16ps, twice fp32's FLOPS.
    An odd input size stays fp32."""

    FORMAT = "panel"

    def __init__(self, linear: nn.Module | Weights, ops, pairs: bool = False, bf16: bool = False,
                 drop_maps: list[tuple[int, int]] | None = None) -> None:
        """``drop_maps`` (file_maps()): the weight is read zero-copy from a safetensors file and nothing else
        reads it: pack it a block of rows at a time and give back each block's file pages once packed, so the
        load never holds the whole table twice (a tied 262k-row vocabulary: 640 MiB fp32)."""
        super().__init__()
        w, b, scale = _weights(linear)
        self.out_features, self.in_features = w.shape
        dtype = w.dtype
        if w.dtype.is_floating_point:  # bias and activations are fp32 whatever the weight's storage
            dtype = torch.bfloat16 if bf16 and self.in_features % 2 == 0 else torch.float32
            b = None if b is None else b.float()
        self.ops, self.pairs, self.bf16_dot = ops, pairs, False  # bf16_dot: int8 rows on vdpbf16ps (bf16 mode)
        if drop_maps is not None and not pairs and self.out_features % 16 == 0:
            self.register_buffer("packed", _pack_in_blocks(ops, w, dtype, drop_maps), persistent=False)
            self.bias = None if b is None else nn.Parameter(b.contiguous(), requires_grad=False)
            self.register_buffer("scale", None if scale is None else scale.contiguous(), persistent=False)
            return
        w = w.to(dtype)
        if pairs:  # [gate; up] rows -> 16 gate rows, the same 16 up rows, ...
            n = self.out_features // 2

            def pairs_of(t):
                return None if t is None else t.view(2, n // 16, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

            w, b, scale = pairs_of(w), pairs_of(b), pairs_of(scale)
        pad = -self.out_features % 16
        if pad:
            w = torch.cat([w, w.new_zeros(pad, self.in_features)])
            b = None if b is None else torch.cat([b, b.new_zeros(pad)])
            scale = None if scale is None else torch.cat([scale, scale.new_zeros(pad)])
        self.register_buffer("packed", ops.pack_panels(w.contiguous()), persistent=False)
        self.bias = None if b is None else nn.Parameter(b.contiguous(), requires_grad=False)
        self.register_buffer("scale", None if scale is None else scale.contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.linear_panels(x, self.packed, self.bias, False, self.scale, bf16_dot=self.bf16_dot)
        if self.pairs:
            return y.view(*y.shape[:-1], -1, 2, 16).transpose(-3, -2).reshape(y.shape)
        return y if y.shape[-1] == self.out_features else y[..., :self.out_features].contiguous()

    def act_mul(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """``act(gate) * up`` of a ``pairs`` projection, ``act`` one of linear.ACTS."""
        return self.ops.linear_panels(x, self.packed, self.bias, ACTS[act], self.scale, bf16_dot=self.bf16_dot)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_mul(x, "silu")

    @property
    def format(self) -> str:
        if self.scale is not None:
            return "panel_int8"
        return "panel_bf16" if self.packed.dtype == torch.bfloat16 else "panel_fp32"

    def stack_spec(self, gate_up: bool, act: str = "silu") -> StackSpec | None:
        if self.pairs != gate_up or self.packed.shape[0] * 16 != self.out_features:  # padded outputs: sliced here
            return None
        return StackSpec(PAIR_KINDS[act][0] if gate_up else PANEL, self.packed,
                         NONE if self.bias is None else self.bias.detach(), NONE if self.scale is None else self.scale,
                         0, 0)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (", int8" if self.scale is not None else ""))


def _stack(linears: list[nn.Module]) -> Weights:
    """The weights of one Linear whose outputs are the concatenated outputs of ``linears`` (same input size,
    all or no bias, all fp32 or all int8)."""
    ws = [_weights(m) for m in linears]
    if len({t[0].dtype for t in ws}) > 1:  # bf16 and fp32 Linears mixed: widen (PanelLinear stores either)
        ws = [(t[0].float(), *t[1:]) for t in ws]
    cat = [None if any(t[i] is None for t in ws) else torch.cat([t[i] for t in ws]) for i in range(3)]
    return cat[0], cat[1], cat[2]


def _packed(linear: nn.Module | Weights, ops, bf16: bool = False) -> nn.Module:
    """``linear`` on the panel kernel with memfit.runtime.kernels' ``ops`` (bf16 weights with ``bf16``), else on
    oneDNN."""
    return PanelLinear(linear, ops, bf16=bf16) if ops is not None else OneDNNLinear(linear)


class FusedSlice(nn.Module):
    """Columns ``[start, stop)`` of a fused projection's output: what one of the fused projections returns.
    SlotModel calls the fused module once (``fused_of``); this keeps the HF model's own forward working. Not a
    format of its own: its weight is the fused module's."""

    FORMAT = "slice"

    def __init__(self, fused: nn.Module, start: int, stop: int) -> None:
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop
        self.in_features, self.out_features = fused.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start:self.stop].contiguous()

    def extra_repr(self) -> str:
        return f"columns [{self.start}, {self.stop}) of a fused {self.fused.out_features}-column projection"


def fused_of(mods: list[nn.Module]) -> nn.Module | None:
    """The fused module whose output is ``cat([m(x) for m in mods], -1)`` where ``pack_linears`` packed ``mods``
    as consecutive slices of one weight, else None."""
    if all(type(m) is FusedSlice for m in mods) and len({id(m.fused) for m in mods}) == 1 \
            and [m.start for m in mods] == [0] + [m.stop for m in mods[:-1]] \
            and mods[-1].stop == mods[0].fused.out_features:
        return mods[0].fused
    return None


# projections of one parent module that read the same input (Llama-family names)
FUSE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _candidates(model: nn.Module, ops=None, bf16: bool = False) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, module) of every fp32 CPU Linear to pack (with ``bf16`` every bf16 one too), and with
    ``ops`` every int8 one."""
    dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    ptrs: dict[int, int] = {}
    for p in model.parameters():
        if not p.is_meta and type(p) in (torch.Tensor, nn.Parameter):
            ptrs[p.data_ptr()] = ptrs.get(p.data_ptr(), 0) + 1
    shared = {ptr for ptr, n in ptrs.items() if n > 1}
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None and not emb.weight.is_meta:
        shared.add(emb.weight.data_ptr())
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if ops is not None and _is_int8(child):
                out.append((parent, name, child))
                continue
            if weight_format(child) != "fp" or not is_resident(child):
                continue
            w = child.weight
            if w.dtype not in dtypes or w.device.type != "cpu" or w.data_ptr() in shared:
                continue
            out.append((parent, name, child))
    return out


@functools.cache
def _faster(out_features: int, in_features: int, threads: int, rounds: int = 5) -> bool:
    """Whether oneDNN's packed Linear beats F.linear on a weight of this shape at M = 1 and M = 16 (best of
    interleaved rounds). Cached: every SlotModel over the same shapes and thread count (bench loops) gets the
    first answer."""
    linear = nn.Linear(in_features, out_features, bias=False)
    packed = _packed(linear, None)
    calls = max(1, min(8, 2**24 // linear.weight.numel()))  # a 7B model's MLP: 1 call a timing, ~0.5 s in all
    best = {"mkl": [float("inf")] * 2, "onednn": [float("inf")] * 2}
    xs = [torch.randn(m, linear.in_features) for m in (1, 16)]
    with torch.inference_mode():
        for _ in range(rounds):
            for kind, f in (("mkl", lambda x: F.linear(x, linear.weight, linear.bias)), ("onednn", packed)):
                for i, x in enumerate(xs):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        f(x)
                    best[kind][i] = min(best[kind][i], time.perf_counter() - t0)
    # a clear win at batch 1 (decode latency) and no loss at batch 16 (continuous batching)
    return best["onednn"][0] < 0.9 * best["mkl"][0] and best["onednn"][1] <= 1.05 * best["mkl"][1]


def file_maps() -> list[tuple[int, int]]:
    """Address ranges of this process's memory maps of *.safetensors files (weights loaded zero-copy)."""
    out: list[tuple[int, int]] = []
    if not sys.platform.startswith("linux"):
        return out
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].endswith(".safetensors"):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b))
    except OSError:
        pass
    return out


def drop_file_pages(t: torch.Tensor, maps: list[tuple[int, int]]) -> None:
    """Give back the page-cache pages of a weight read zero-copy from a safetensors file once nothing uses
    it: they are clean copies of the file, but still count in the server's RSS (measured +124 MiB for the
    serving benchmark's 33.7M model). Only whole pages inside the tensor, only inside a file mapping."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    if not any(a <= start and end <= b for a, b in maps):
        return
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if hi > lo:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED


def pack_linears(model: nn.Module, mode: str = "auto", ops=None, bf16: bool = False) -> int:
    """Replace the model's eligible fp32 CPU Linears by PanelLinear (with memfit.runtime.kernels' ``ops``; with
    ``bf16`` their weights in bf16, and bf16 Linears too) or OneDNNLinear; returns how many were replaced."""
    if mode not in MODES:
        raise ValueError(f"dense kernel mode must be one of {MODES}, not {mode!r}")
    bf16 = bf16 and ops is not None
    if mode == "off" or (ops is None and not available()):
        return 0
    todo = _candidates(model, ops, bf16)
    if not todo:
        return 0
    fp = [c for _, _, c in todo if weight_format(c) == "fp"]
    # int8 and bf16 weights are always packed: their fallbacks dequantize per call or run bf16 matmuls. With
    # memfit's kernels fp32 ones are too: packing is also what fuses q/k/v and gate/up (activation in the GEMM's
    # epilogue) and puts the layers on the C++ loop, which no single Linear's timing sees. Timed per shape it
    # said no at random on this CPU (a weight hot in cache favours MKL), and then a decode step of a random
    # SmolLM2-135M-shaped Llama took 29.5 ms, packed 18.9 (batch 16: 77.2 vs 32.8; 2 threads, AVX-512 Xeon).
    if mode == "auto" and fp and not bf16 and ops is None:
        largest = max(fp, key=lambda c: c.in_features * c.out_features)
        if not _faster(largest.out_features, largest.in_features, torch.get_num_threads()):
            todo = [t for t in todo if weight_format(t[2]) != "fp"]
            if not todo:
                return 0
    maps = file_maps()
    by_parent: dict[int, tuple[nn.Module, dict[str, nn.Linear]]] = {}
    for parent, name, child in todo:
        by_parent.setdefault(id(parent), (parent, {}))[1][name] = child
    for parent, children in by_parent.values():
        originals = list(children.values())
        for group in FUSE_GROUPS:
            mods = [children.get(n) for n in group]
            if any(m is None for m in mods) or \
                    len({(m.in_features, _is_int8(m), _has_bias(m)) for m in mods}) != 1:
                continue
            if group == ("gate_proj", "up_proj") and ops is not None and mods[0].out_features % 16 == 0 \
                    and mods[0].out_features == mods[1].out_features:
                fused = PanelLinear(_stack(mods), ops, pairs=True, bf16=bf16)
            else:
                fused = _packed(_stack(mods), ops, bf16)
            start = 0
            for n, m in zip(group, mods, strict=True):
                setattr(parent, n, FusedSlice(fused, start, start + m.out_features))
                start += m.out_features
                del children[n]
        for name, child in children.items():
            setattr(parent, name, _packed(child, ops, bf16))
        # nothing else reads these weights now (candidates share no storage): their file pages go at once, not
        # after the last layer, or the load holds every fp32 Linear's pages next to its packed copy
        for child in originals:
            if weight_format(child) == "fp" and child.weight.dtype in (torch.float32, torch.bfloat16):
                drop_file_pages(child.weight.detach(), maps)
    return len(todo)
