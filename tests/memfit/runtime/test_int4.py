"""memfit.runtime.int4: one int4 kernel call for q/k/v (or gate/up) equals the separate projections, on any CPU."""

from __future__ import annotations

import pytest
import torch

from compress.quant import QuantArgs
from compress.rtn import rtn
from memfit.runtime.fuse import fuse
from memfit.runtime.int4 import FusedInt4Linear, Int4KernelLinear, _pack_concatenates, int4_on_kernels
from memfit.runtime.linear import INT4, INT4_GATE_UP, weight_format
from memfit.runtime.qlinear import Int4CpuLinear, quant_linear

from .conftest import int4_rounds_decode_x


def _linears(rows: list[int], k: int = 256) -> list[Int4CpuLinear]:
    g = torch.Generator().manual_seed(sum(rows))
    return [quant_linear(rtn(torch.randn(n, k, generator=g), QuantArgs(4, 64, False)), None) for n in rows]


@pytest.mark.parametrize("rows", [[128, 64, 64], [1408, 1408], [64, 32, 32], [48, 16, 16]])
def test_fused_int4_equals_separate_calls_or_is_refused(rows: list[int]) -> None:
    mods = _linears(rows)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    separate = torch.cat([m(x) for m in mods], -1)
    f = fuse(mods)
    # splits on 64-row boundaries are whole blocks of every CPU layout: they must fuse
    assert (f is not None) == _pack_concatenates(tuple(rows))
    if all(n % 64 == 0 for n in rows):
        assert f is not None
    if f is not None:
        assert type(f) is FusedInt4Linear and weight_format(f) == "int4_fused" and f.stack_spec(False) is None
        torch.testing.assert_close(f(x), separate, atol=0, rtol=0)
        torch.testing.assert_close(torch.cat([m(x) for m in mods], -1), separate, atol=0, rtol=0)  # views intact
    # every projection's own call is unchanged either way
    for m, y in zip(mods, torch.split(separate, rows, dim=-1), strict=True):
        torch.testing.assert_close(m(x), y, atol=0, rtol=0)


def test_pack_probe_accepts_whole_blocks() -> None:
    # which smaller splits scramble rows depends on the CPU (AVX-512: anything not a multiple of 64); the
    # parametrized test above checks the safety property on any CPU: fused output == separate calls
    assert _pack_concatenates((64, 64))
    assert _pack_concatenates((128, 64, 64))


def _exact(m: Int4CpuLinear, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T in fp32 with W = (q - 8) * scale + zero rebuilt from the module's own codes and bf16 scales."""
    from memfit.runtime.kernels import int4_block

    b = int4_block()
    n, k, gs = m.out_features, m.in_features, m.group_size
    by = m.packed.contiguous().view(torch.uint8).view(n // b, k, b // 2).to(torch.int32)
    codes = torch.cat([by & 15, by >> 4], dim=-1).transpose(1, 2).reshape(n, k)  # undo the [n/b, k, b/2] pack
    sz = m.scale_zeros.float()
    w = (codes.float() - 8) * sz[..., 0].t().repeat_interleave(gs, 1) + sz[..., 1].t().repeat_interleave(gs, 1)
    return x @ w.t()


def _int16_groups(x: torch.Tensor, gs: int) -> torch.Tensor:
    """x rounded as int4_linear's vpdpwssd rows round it: to int16 per (row, group of gs), scale max|x| / 32767."""
    amax = x.view(x.shape[0], -1, gs).abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 32767 / amax, 0)  # the kernel's float ops, so that ties round alike
    return (torch.round(x.view(x.shape[0], -1, gs) * inv) * (amax / 32767)).view_as(x)


def _kernel_x(x: torch.Tensor, gs: int = 64) -> torch.Tensor:
    """The x the kernel multiplies exactly: rounded to int16 per group on 1-4 rows where the build does that."""
    return _int16_groups(x, gs) if x.shape[0] <= 4 and int4_rounds_decode_x() else x


def test_int4_kernel_equals_the_exact_dequantized_product() -> None:
    from memfit.runtime import kernels

    ops = kernels.load("on")
    assert kernels.int4_block() in (32, 64)
    mods = _linears([128, 64, 64])
    xs = [torch.randn(r, 256, generator=torch.Generator().manual_seed(r)) for r in (1, 3, 4, 5, 16, 70)]
    want = [[_exact(m, _kernel_x(x)) for m in mods] for x in xs]
    f = fuse(mods, ops)
    parent = torch.nn.Module()
    parent.a, parent.b, parent.c = mods
    parent.other = torch.nn.Linear(4, 4)
    assert int4_on_kernels(parent, ops) == 3
    assert type(parent.a) is Int4KernelLinear and type(parent.other) is torch.nn.Linear
    assert weight_format(parent.a) == "int4_kernel" and weight_format(parent.other) == "fp"
    # what the C++ layer loop gets: the fused pack as one INT4 projection, no gate/up pairs for 3 unequal parts
    spec = f.stack_spec(False)
    assert spec.kind == INT4 and spec.a is f.packed and spec.group == 64 and f.stack_spec(True) is None
    assert parent.a.stack_spec(False).kind == INT4 and parent.a.stack_spec(True) is None
    for x, ws in zip(xs, want, strict=True):
        torch.testing.assert_close(f(x), torch.cat(ws, -1), atol=1e-4, rtol=1e-4)
        for name, w in zip("abc", ws, strict=True):
            torch.testing.assert_close(getattr(parent, name)(x), w, atol=1e-4, rtol=1e-4)
    # the bf16 path of compress's own module stays within bf16 rounding of it
    torch.testing.assert_close(mods[0](xs[1]), _exact(mods[0], xs[1]), atol=0.15, rtol=0.05)
    assert int4_on_kernels(parent, None) == 0


def test_equal_halves_fuse_as_silu_pairs() -> None:
    from memfit.runtime import kernels

    ops = kernels.load("on")
    gate, up = _linears([128, 128])
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2))
    f = fuse([gate, up], ops)
    assert f.pairs and f.stack_spec(True).kind == INT4_GATE_UP
    gu = f(x)  # [gate | up] from the same fp32 kernel
    want = torch.nn.functional.silu(gu[:, :128]) * gu[:, 128:]
    torch.testing.assert_close(f.silu_mul(x), want, atol=1e-5, rtol=1e-5)


def test_int4_bf16_dot_rounds_x_and_weights_to_bf16_from_8_rows() -> None:
    """The engine's bf16 mode: from 8 rows (prefill) on AVX512-BF16, x and the dequantized weights are rounded to
    bf16 and multiplied with vdpbf16ps; fewer rows (decode) stay as without the flag. Without it every size is
    exact but for the decode rows' int16 x (the next test)."""
    from memfit.runtime import kernels

    ops = kernels.load("on")
    mods = _linears([128, 64, 64])
    f = fuse(mods, ops)
    f.bf16_dot = True
    for rows in (1, 4, 7, 8, 16, 70):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        exact = torch.cat([_exact(m, x) for m in mods], -1)
        if rows >= 8 and ops.has_avx512_bf16():
            ws = [_exact(m, torch.eye(256)).t() for m in mods]  # W [n, k], dequantized
            want = torch.cat([x.bfloat16().float() @ w.bfloat16().float().t() for w in ws], -1)
            assert (f(x) - exact).abs().max() > 1e-3  # it did round
        else:
            want = torch.cat([_exact(m, _kernel_x(x)) for m in mods], -1)
        torch.testing.assert_close(f(x), want, atol=1e-4, rtol=1e-4)


def test_int4_decode_rows_on_vnni_multiply_x_rounded_to_int16_per_group() -> None:
    """1-4 rows on AVX512-VNNI + VBMI builds (64-row blocks): x rounded to int16 per (row, group), then the exact
    product with the dequantized W; 5 rows on, and on other CPUs, x as it is. NaN in x still reaches y."""
    from memfit.runtime import kernels

    ops = kernels.load("on")
    mods = _linears([128, 64, 64])
    f = fuse(mods, ops)
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        x[:, 7] *= 80  # an outlier channel: its group's step is ~80x the others'
        exact = torch.cat([_exact(m, x) for m in mods], -1)
        if rows <= 4 and int4_rounds_decode_x():
            assert (f(x) - exact).abs().max() > 1e-3  # it did round
        want = torch.cat([_exact(m, _kernel_x(x)) for m in mods], -1)
        torch.testing.assert_close(f(x), want, atol=1e-4, rtol=1e-4)
        x[0, 3] = float("nan")
        y = f(x)
        assert y[0].isnan().all() and not y[1:].isnan().any()
