"""Loading: compress dispatch on quantization_config, load-time quantization through the engine, dtypes."""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest
import torch

from memfit.errors import UserError
from memfit.runtime.int4 import _pack_concatenates
from memfit.runtime.slot_model import Segment, SlotModel
from serve.loader import load


def test_quantization_config_dispatches_to_compress_load(model_dir, loaded, tmp_path, monkeypatch):
    d = tmp_path / "q"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "memfit", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    calls = []
    fake = types.ModuleType("compress")

    def fake_load(path, device="cpu"):
        calls.append((path, device))
        return loaded.model

    fake.load = fake_load
    monkeypatch.setitem(sys.modules, "compress", fake)
    out = load(str(d))
    assert calls == [(str(d), "cpu")] and out.model is loaded.model and out.quantized == "compress"
    with pytest.raises(UserError):
        load(str(d), quantize="int8")


@pytest.mark.parametrize("method", ["int8", "nf4"])
def test_load_time_quantization_runs_in_the_slot_engine(model_dir, loaded, method):
    if method == "nf4":
        pytest.importorskip("bitsandbytes")
    q = load(model_dir, quantize=method)
    assert q.quantized == method
    lin = q.model.model.layers[0].self_attn.q_proj
    assert type(lin) is not torch.nn.Linear
    ids = torch.tensor(loaded.tokenizer("ROMEO. But soft, what light")["input_ids"])
    got = SlotModel(q.model, 1, 64).forward(ids, [Segment(0, 0, len(ids))])[0]
    ref = SlotModel(loaded.model, 1, 64).forward(ids, [Segment(0, 0, len(ids))])[0]
    assert torch.isfinite(got).all()
    # quantization error is visible but small against the logit spread
    assert not torch.equal(got, ref)
    assert (got - ref).abs().max() < 0.25 * (ref.max() - ref.min())


def test_bf16_dtype(model_dir, loaded):
    b = load(model_dir, dtype="bf16")
    sm = SlotModel(b.model, 1, 32)
    assert sm.k_cache[0].dtype == torch.bfloat16
    ids = torch.tensor([10, 11, 12, 13])
    got = sm.forward(ids, [Segment(0, 0, 4)])[0]
    with torch.no_grad():
        ref = b.model(ids[None]).logits[0, -1].float()
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0.05)


def test_compress_4bit_output_serves_and_matches_its_hf_forward(model_dir, tmp_path):
    cli = pytest.importorskip("compress.cli")
    out = tmp_path / "q4"
    assert cli.main(["quantize", model_dir, "-o", str(out), "--bits", "4", "--method", "rtn",
                     "--group-size", "32"]) == 0
    q = load(str(out))
    assert q.quantized == "compress"
    assert type(q.model.model.layers[0].mlp.down_proj) is not torch.nn.Linear
    ids = torch.tensor(q.tokenizer("ROMEO. But soft, what light")["input_ids"])
    sm = SlotModel(q.model, 2, 64)
    # the int4 q/k/v and gate/up projections run fused (memfit.runtime.fuse); the HF forward below runs them one by one
    assert q.model.model.layers[0].mlp.up_proj.backend == "int4_cpu"
    # fused wherever the CPU's int4 layout allows it (tests/memfit/runtime/test_int4.py); separate calls otherwise
    ly = q.model.model.layers[0]
    rows = tuple(m.out_features for m in (ly.self_attn.q_proj, ly.self_attn.k_proj, ly.self_attn.v_proj))
    assert (sm.qkv[0] is not None) == _pack_concatenates(rows)
    got = sm.forward(ids[:5], [Segment(1, 0, 5)])  # chunked over the quantized Linears
    got = sm.forward(ids[5:], [Segment(1, 5, len(ids) - 5)])[0]
    with torch.no_grad():
        ref = q.model(ids[None]).logits[0, -1].float()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def _rss_file_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_quantizing_at_load_gives_back_the_page_cache_of_the_weights_it_replaced(tmp_path):
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16384, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    shutil.copy(Path(__file__).parents[2] / "models" / "shakespeare-llama" / "tokenizer.json", tmp_path / "m")
    read_kib = (4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 1024) + 16384 * 256) * 4 // 1024  # 32.5 MiB
    before = _rss_file_kib()
    loaded = load(str(tmp_path / "m"), quantize="int8", quantize_embeddings="int8")
    assert type(loaded.model.lm_head).__name__ == "Int8RowsLinear"
    # quantizing read every fp32 weight from the file mapping; their pages are dropped again
    assert _rss_file_kib() - before < read_kib // 4


def test_quantize_int8_scales_each_output_row(model_dir):
    """serve --quantize int8: one scale per output row (per-channel), not torch's default single scale per
    tensor, which let Gemma 3 270M's outlier rows coarsen every row (KL to fp32 0.08 -> 0.004 per-channel)."""
    q = load(model_dir, quantize="int8")
    w = q.model.model.layers[0].mlp.down_proj.weight()
    assert w.qscheme() == torch.per_channel_affine
    assert w.q_per_channel_scales().unique().numel() > 1
