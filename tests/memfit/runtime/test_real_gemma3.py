"""SlotModel on the real Gemma 3 270M (``make real-model``; skipped without it): a 1,500-token prompt, past the
512-token window of its sliding layers, prefilled in 256-token chunks, then decodes, against HF's forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memfit.runtime.slot_model import Segment, SlotModel

GEMMA = Path(__file__).resolve().parents[3] / ".cache" / "models" / "gemma3-270m"
pytestmark = pytest.mark.skipif(not (GEMMA / "config.json").is_file(), reason="make real-model not run")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.slow
def test_long_prompt_logits_match_hf_within_1e4_relative() -> None:
    from memfit.hf import load_pretrained

    model = load_pretrained(str(GEMMA)).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 200000, (1503,), generator=g)
    keep = [1499, 1500, 1501, 1502]
    with torch.inference_mode():  # HF: hidden states, then lm_head on the rows compared only (262k vocabulary)
        hidden = model.model(input_ids=ids[None]).last_hidden_state[0]
        ref = model.lm_head(hidden[keep]).float()
    # "on", not serve's "auto": auto times the kernels at load and may leave the projections to MKL on a busy host
    sm = SlotModel(model, 2, 1600, dense_kernel="on", cpu_kernels="on")
    assert sm.stack is not None  # the C++ layer loop (fast_stack): windows, sandwich and q/k norms, GELU-tanh
    got = []
    for start in range(0, 1500, 256):
        n = min(256, 1500 - start)
        out = sm.forward(ids[start:start + n], [Segment(0, start, n, want_logits=start + n == 1500)])
    got.append(out[0])
    for pos in range(1500, 1503):
        got.append(sm.forward(ids[pos:pos + 1], [Segment(0, pos, 1)])[0])
    for p, g_, r in zip(keep, got, ref, strict=True):
        assert _rel(g_, r) < 1e-4, (p, _rel(g_, r))
