"""compress on CUDA: the Int4CudaLinear format (aten._weight_int4pack_mm, tinygemm layout) and compress outputs
loaded onto the GPU, against dequantized-weight references.

Skipped without CUDA. ``MEMFIT_TEST_DEVICE=cpu`` runs the same bodies on CPU, where the int4 backend is
int4_cpu (same W = (q - 8) * s + z convention, so the same references apply). Needs neither compressed-tensors
(our loader reads the format itself; compress.sparse_store imports it only for sparse outputs) nor bitsandbytes
(its one test is skipped without it).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import compress
from compress import calib
from compress.cli import evaluate_dirs, main
from compress.evaluate import perplexity
from compress.quant import QuantArgs
from compress.rtn import rtn
from memfit.hf import load_tokenizer
from memfit.runtime.qlinear import QUANT_LINEARS, pick_backend, quant_linear

from .conftest import make_model_dir
from .test_quantize import reference

DEVICE = torch.device(os.environ.get("MEMFIT_TEST_DEVICE") or "cuda")
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")
INT4 = "int4_cuda" if DEVICE.type == "cuda" else "int4_cpu"


def _loader_missing() -> str | None:
    """Why compress.load / the compress CLI cannot be imported here, or None. They need compressed-tensors only
    for sparse outputs (imported lazily in compress.sparse_store); should a top-level import of an absent
    package come back, the tests below skip naming it instead of failing in their fixtures."""
    try:
        import compress.loader  # noqa: F401
        from compress.cli import build_parser

        build_parser()
    except ModuleNotFoundError as e:
        return f"compress.load / the compress CLI need {e.name!r}, not installed here"
    return None


needs_loader = pytest.mark.skipif(_loader_missing() is not None, reason=str(_loader_missing()))
IDS = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(0))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    dev = next(model.buffers()).device  # compress models may hold their Linears as buffers only
    with torch.no_grad():
        return model(input_ids=ids.to(dev)).logits.float().cpu()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want.float().cpu()).abs().max() / want.float().abs().max())


def _kernel_weight(q, out: int, cols: int) -> torch.Tensor:
    """W as the int4 kernels see it: W = (q - 8) * s + z with s and z = (8 - zero) * s each rounded to bf16
    (the int4 formats store them as bf16 scale_zeros), computed in fp32."""
    g = q.group_size
    s = q.scale.float().to(torch.bfloat16).float()
    z = ((8 - q.zero.float()) * q.scale.float()).to(torch.bfloat16).float()
    return ((q.codes.float().view(out, -1, g) - 8) * s[..., None] + z[..., None]).view(out, cols)


@pytest.mark.parametrize("group,sym", [(32, False), (64, True), (128, False), (256, True)])
def test_int4_linear_matches_its_dequantized_weight(group: int, sym: bool) -> None:
    out, cols = 256, 1024  # in_features a multiple of 1024: pick_backend's condition for int4_cuda
    g = torch.Generator().manual_seed(group)
    w = torch.randn(out, cols, generator=g) * 0.05
    bias = torch.randn(out, generator=g)
    q = rtn(w, QuantArgs(4, group, sym))
    ql = quant_linear(q, bias, device=DEVICE)
    assert ql.backend == INT4, ql
    assert ql.packed.device.type == DEVICE.type and ql.scale_zeros.dtype == torch.bfloat16
    wk = _kernel_weight(q, out, cols)
    # the packed layout (nibble order, tiles) decoded back through the kernel itself: a wrong pack is off by O(1)
    dq = ql.dequantized_weight()
    assert dq.shape == (out, cols)
    assert _rel_err(dq, wk) <= 2**-7, _rel_err(dq, wk)
    cpu = quant_linear(q, bias, device="cpu")  # int4_cpu: the backend the CPU suite tests
    for shape in ((1, cols), (5, cols), (33, cols), (2, 7, cols)):  # decode, small and tiled M, 3-D input
        x = torch.randn(*shape, generator=g)
        y = ql(x.to(DEVICE))
        assert y.shape == (*shape[:-1], out) and y.dtype == torch.float32 and y.device.type == DEVICE.type
        want = F.linear(x.to(torch.bfloat16).float(), wk, bias)  # bf16 activations, as the kernel runs them
        assert _rel_err(y, want) < 1e-2, (shape, _rel_err(y, want))
        assert _rel_err(y, cpu(x)) < 1e-2, (shape, _rel_err(y, cpu(x)))
    # and close to the exact fp32 dequantization (what backend="dequant" computes)
    x = torch.randn(4, cols, generator=g)
    assert _rel_err(ql(x.to(DEVICE)), F.linear(x, q.dequantize(), bias)) < 2e-2


@pytest.mark.parametrize("bits,cols", [(4, 512), (8, 1024), (3, 1024)])
def test_dequant_backend_on_device_is_exact(bits: int, cols: int) -> None:
    g = torch.Generator().manual_seed(bits)
    q = rtn(torch.randn(64, cols, generator=g) * 0.05, QuantArgs(bits, 128, False))
    # 4-bit with in_features not a multiple of 1024 falls back to dequant on CUDA (int4_cpu takes it on CPU)
    expect = "dequant" if bits != 4 or DEVICE.type == "cuda" else "int4_cpu"
    assert pick_backend(q, DEVICE) == expect
    ql = quant_linear(q, None, device=DEVICE, backend="dequant")
    x = torch.randn(3, cols, generator=g)
    torch.testing.assert_close(ql(x.to(DEVICE)).cpu(), F.linear(x, q.dequantize()), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """hidden = intermediate = 1024: every decoder Linear qualifies for int4_cuda (in_features % 1024 == 0)."""
    return make_model_dir(tmp_path_factory.mktemp("wide") / "fp", hidden=1024, inter=1024)


@pytest.fixture(scope="module")
def wide_q4(wide: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wide-q4") / "q4"
    assert main(["quantize", str(wide), "-o", str(out), "--method", "rtn", "--bits", "4"]) == 0  # group 128
    return out


@needs_loader
def test_compress_load_on_device_uses_the_int4_kernel(wide: Path, wide_q4: Path) -> None:
    model = compress.load(wide_q4, device=str(DEVICE))
    qls = [m for m in model.modules() if isinstance(m, QUANT_LINEARS)]
    assert len(qls) == 2 * 7 and {m.backend for m in qls} == {INT4}, {m.backend for m in qls}
    tensors = list(model.parameters()) + list(model.buffers())
    assert all(t.device.type == DEVICE.type for t in tensors)
    got = _logits(model, IDS)
    want = _logits(reference(wide, wide_q4), IDS)  # fp32 CPU model with the stored codes dequantized
    # the CPU suite's thresholds for the int4_cpu kernel (tests/compress/test_quantize.py)
    assert _rel_err(got, want) < 3e-2, _rel_err(got, want)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    fp = _logits(compress.load(wide), IDS)
    assert (want - fp).abs().max() > 0  # it really is quantized


@needs_loader
def test_slot_model_over_int4_model_matches_its_hf_forward(wide_q4: Path) -> None:
    """serve's packed forward calls the same quantized Linear modules (q/k/v not fused: memfit.runtime.fuse fuses
    int4_cpu only) on the GPU."""
    from memfit.runtime.slot_model import Segment, SlotModel

    model = compress.load(wide_q4, device=str(DEVICE))
    ids = IDS[0]
    ref = _logits(model, ids[None])[0]
    sm = SlotModel(model, 2, 64)
    assert sm.stack is None and (sm.qkv[0] is None or DEVICE.type == "cpu")
    out = sm.forward(ids[:40], [Segment(1, 0, 40)])
    assert _rel_err(out[0], ref[39]) < 3e-2
    for pos in range(40, 44):  # decodes
        out = sm.forward(ids[pos:pos + 1], [Segment(1, pos, 1)])
        assert _rel_err(out[0], ref[pos]) < 3e-2, pos


@needs_loader
def test_eval_on_device(wide: Path, wide_q4: Path, eval_file: Path, monkeypatch) -> None:
    """`compress eval --device cuda`: perplexity and serve-engine decode speed of the fp and 4-bit models."""
    from memfit.runtime import kernels

    # the "serve" decode engine asks for the CPU kernels (auto): skip their ~40 s C++ build, which a CUDA model
    # does not use anyway (what a failed build does: torch ops)
    monkeypatch.setattr(kernels, "load", lambda mode: None)
    rows = evaluate_dirs([str(wide), str(wide_q4)], [eval_file], 64, 2048, 4, device=str(DEVICE),
                         decode_engine="serve")
    fp, q4 = rows
    for r in rows:
        assert math.isfinite(r["ppl"]) and 1 < r["ppl"] < 1000, r  # vocab 320: a random model is near uniform
        assert r["tok_s"] > 0 and r["engine"] == "serve", r
    # the fp model's perplexity on the device is the CPU one (fp32 both), and 4 bits cost little (1.005x on CPU)
    tokens = calib.eval_tokens(load_tokenizer(str(wide)), [eval_file], 2048)
    assert fp["ppl"] == pytest.approx(perplexity(compress.load(wide), tokens, 64), rel=1e-3)
    assert 0.9 < q4["ppl"] / fp["ppl"] < 1.1, (fp["ppl"], q4["ppl"])


@needs_loader
def test_bitsandbytes_nf4_output_loads_on_device(tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "nf4"
    assert main(["quantize", str(tiny), "-o", str(out), "--method", "nf4", "--bits", "4"]) == 0
    model = compress.load(out, device=str(DEVICE))
    layer = model.model.layers[0].mlp.up_proj
    assert type(layer).__name__ == "Linear4bit" and layer.weight.device.type == DEVICE.type
    got = _logits(model, IDS)
    fp = _logits(compress.load(tiny), IDS)
    assert torch.isfinite(got).all() and not torch.equal(got, fp)
    assert (got - fp).abs().max() < 0.5 * fp.abs().max()
