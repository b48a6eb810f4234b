"""LayerJob's memo of finished children and the symmetric Hessian: both must leave GPTQ's result unchanged."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from compress import gptq
from compress.gptq import Hessian
from compress.layerjob import LayerJob
from compress.quant import QuantArgs
from compress.walk import capture_inputs

IDS = torch.randint(0, 300, (6, 40), generator=torch.Generator().manual_seed(1))


def test_hessian_adds_only_the_upper_blocks_and_mirrors_them(monkeypatch) -> None:
    monkeypatch.setattr(gptq, "HESSIAN_BLOCK", 96)  # 300 columns: 4 blocks, the last one short
    xs = [torch.randn(2, 17, 300) for _ in range(3)]
    h = Hessian(300)
    for x in xs:
        h.add(x)
    rows = torch.cat([x.reshape(-1, 300) for x in xs])
    want = rows.t() @ rows * (2 / rows.shape[0])
    assert torch.allclose(h.H, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(h.H, h.H.t())


def _layer_job(tiny: Path) -> LayerJob:
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    layer = model.model.layers[0]
    inputs = capture_inputs(model, model.model.layers, IDS, 2)  # 3 batches
    lin = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    return LayerJob(layer, "model.layers.0.", lin, {n: QuantArgs(4, 64, False) for n in lin}, model.config, inputs,
                    {"act_order": True})


def test_gptq_with_the_memo_equals_gptq_without(tiny: Path, monkeypatch) -> None:
    plain_job = _layer_job(tiny)
    monkeypatch.setattr(LayerJob, "done", lambda self, names: None)
    plain = gptq.quantize_layer(plain_job)
    plain_out = plain_job.run()
    monkeypatch.undo()

    job = _layer_job(tiny)
    calls = []
    job.layer.self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    got = gptq.quantize_layer(job)
    out = job.run()
    assert set(job.memo) == {"self_attn", "mlp"} and len(job.memo["self_attn"]) == 3
    # q_proj runs in sequential_groups (1 batch), not in the q/k/v pass (it stops at q_proj's input), in the
    # o_proj pass (3) and the gate/up pass, which records self_attn (3); never again (down pass, output pass)
    assert len(calls) == 1 + 3 + 3
    for n in plain:
        assert torch.equal(got[n].codes, plain[n].codes), n
        assert torch.equal(got[n].scale, plain[n].scale), n
    for a, b in zip(out, plain_out, strict=True):
        assert torch.equal(a, b)


class _Twice(nn.Module):
    """A layer that calls its child twice on different inputs: the memo must not replay it."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x) * 2)


def test_a_child_called_twice_is_never_replayed() -> None:
    torch.manual_seed(0)
    layer = _Twice()
    inputs = [((torch.randn(3, 8),), {}) for _ in range(2)]
    job = LayerJob(layer, "l.", {"block.0": layer.block[0]}, {}, None, inputs)
    want = job.run()
    job.done(["block.0"])
    assert "block" in job.memo
    assert all(torch.equal(a, b) for a, b in zip(job.run(), want, strict=True))
    assert job.memo["block"] is None
    assert all(torch.equal(a, b) for a, b in zip(job.run(), want, strict=True))


def test_an_instance_forward_set_by_someone_else_survives_a_run() -> None:
    layer = _Twice()
    inner = layer.block.forward  # the bound method, set as an instance attribute (as accelerate's hooks do)
    layer.block.forward = inner
    job = LayerJob(layer, "l.", {"block.0": layer.block[0]}, {}, None, [((torch.randn(3, 8),), {})])
    job.done(["block.0"])
    job.run()
    assert layer.block.__dict__["forward"] is inner
