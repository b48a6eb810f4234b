from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from compress.packing import pack_int32, unpack_int32
from compress.quant import QuantArgs, dequantize
from compress.rtn import rtn
from memfit.runtime.qlinear import quant_linear


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(16, 256), (7, 37), (64, 320)])
def test_pack_unpack_round_trip_and_matches_compressed_tensors(bits: int, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, shape, generator=g, dtype=torch.uint8)
    for dim in (0, 1):
        packed = pack_int32(codes, bits, dim=dim)
        assert packed.dtype == torch.int32
        assert torch.equal(unpack_int32(packed, bits, shape[dim], dim=dim), codes)
        signed = (codes.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)
        assert torch.equal(packed, pack_to_int32(signed, bits, packed_dim=dim))


def test_four_bit_is_two_values_per_byte() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.uint8)
    packed = pack_int32(codes, 4)
    assert packed.shape == (1, 1)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x43, 0x65, 0x87]]


def test_pack_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        pack_int32(torch.tensor([[16]], dtype=torch.uint8), 4)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_rtn_error_bounded_by_half_step(bits: int, sym: bool) -> None:
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    q = rtn(w, QuantArgs(bits, 64, sym))
    err = (q.dequantize() - w).abs().view(32, 4, 64)
    # half a step, plus how far the clipped extreme can overshoot under an fp16-rounded scale
    bound = 0.5 + (2 ** (bits - 1) if sym else 2**bits - 1) * 2**-11
    assert (err <= q.scale.unsqueeze(-1) * bound + 1e-6).all()
    assert int(q.codes.max()) < 2**bits


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_int4_kernel_equals_dequantized_matmul(group: int, sym: bool) -> None:
    g = torch.Generator().manual_seed(group)
    w = torch.randn(96, 256, generator=g)
    q = rtn(w, QuantArgs(4, group, sym))
    fast = quant_linear(q, torch.randn(96, generator=g))
    assert fast.backend == "int4_cpu"
    ref = quant_linear(q, fast.bias, backend="dequant")
    for m in (1, 5, 64):
        x = torch.randn(2, m, 256, generator=g)
        expect = x @ dequantize(q.codes, q.scale, q.zero, group).t() + fast.bias
        assert torch.allclose(ref(x), expect, atol=1e-5, rtol=1e-5)
        # bf16 activations and bf16 scales in the kernel: agree to bf16 precision
        assert torch.allclose(fast(x), expect, atol=2e-2 * expect.abs().max().item(), rtol=0)
        assert (fast(x) - expect).abs().mean() < 1e-2 * expect.abs().mean()


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_other_widths_use_dequant_backend(bits: int) -> None:
    q = rtn(torch.randn(32, 128), QuantArgs(bits, 128, False))
    lin = quant_linear(q, None)
    assert lin.backend == "dequant"
    x = torch.randn(3, 128)
    assert torch.allclose(lin(x), x @ q.dequantize().t(), atol=1e-5)
