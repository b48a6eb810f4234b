"""serve.fuse: one int4 kernel call for q/k/v (or gate/up) equals the separate projections, on any CPU."""

from __future__ import annotations

import pytest
import torch

from compress.qlinear import QuantLinear
from compress.quant import QuantArgs
from compress.rtn import rtn
from serve.fuse import _pack_concatenates, fuse


def _linears(rows: list[int], k: int = 256) -> list[QuantLinear]:
    g = torch.Generator().manual_seed(sum(rows))
    return [QuantLinear(rtn(torch.randn(n, k, generator=g), QuantArgs(4, 64, False)), None) for n in rows]


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
