"""training on CUDA: the loop with bf16/fp16 autocast, activation checkpointing, LoRA, resume, and the memory
report's peak CUDA memory.

Skipped without CUDA. ``MEMFIT_TEST_DEVICE=cpu`` runs the device-generic bodies on CPU (a check of the tests
themselves on a machine without a GPU; train() picks CUDA whenever torch sees one, so that mode is only
meaningful where none is visible). Tests marked ``cuda_only`` need a real GPU whatever that says.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from training import precision as amp
from training.loop import train
from training.losses import plain_causal_lm_loss

from .conftest import TINY_MODEL, assert_lora_outputs, read_metrics

DEVICE = torch.device(os.environ.get("MEMFIT_TEST_DEVICE") or "cuda")
pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a real CUDA device")
REPO = Path(__file__).resolve().parents[2]


def _reset_peak() -> int:
    """Reset the CUDA high-water mark; returns the bytes still allocated (by earlier tests) it starts from.
    MemoryReport.peak_cuda is torch.cuda.max_memory_allocated(), a process-wide mark that train() never resets:
    without this, one test's peak would show up in the next one's report."""
    if not torch.cuda.is_available():
        return 0
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _losses(run_dir: str | Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


def _check_report(rep: dict, base: int) -> None:
    assert rep["parameters"] > 0 and rep["activations"] > 0 and rep["optimizer_state"] >= 2 * rep["gradients"]
    if DEVICE.type == "cuda":
        # parameters, gradients and AdamW's two moments are all on the GPU at the report (after the first step);
        # the rest of a tiny model's peak is activations and workspaces, far below 256 MiB
        static = rep["parameters"] + rep["gradients"] + rep["optimizer_state"]
        assert rep["peak_cuda"] is not None and base + static <= rep["peak_cuda"] < base + static + 2**28, rep


def test_bf16_autocast_with_checkpointing_learns_and_matches_no_checkpointing(make_cfg, tmp_path):
    if DEVICE.type == "cuda":
        assert torch.cuda.is_bf16_supported() and amp.resolve("auto", DEVICE).name == "bf16"
    runs = {}
    for mode in ("none", "full", "every_k"):
        base = _reset_peak()
        out = tmp_path / mode
        result = train(make_cfg(precision="bf16", checkpointing=mode, max_steps=8, output_dir=str(out),
                                model_config={**TINY_MODEL, "num_hidden_layers": 4}),
                       memory_report=True)
        runs[mode] = (result, _losses(out), read_metrics(out), base)
    none, full, every = runs["none"], runs["full"], runs["every_k"]
    losses = full[1]
    assert all(math.isfinite(x) for x in losses)
    # a fresh model starts near uniform, ln(vocab), and learns a lot in 8 steps of a 20-word corpus
    assert abs(losses[0] - math.log(320)) < 0.25 and losses[-1] < losses[0] - 1.0, losses
    # recomputation runs the same bf16 ops: the same losses (up to the GPU's non-deterministic reductions)
    for other in (none, every):
        assert other[1] == pytest.approx(losses, abs=2e-3), (other[1], losses)
    acts = {m: r[0]["memory_report"]["activations"] for m, r in runs.items()}
    assert acts["full"] < acts["every_k"] < acts["none"], acts
    for result, _, rows, base in runs.values():
        _check_report(result["memory_report"], base)
        assert all(r["mem_mib"] > 0 for r in rows)
    # the master weights stay fp32 under autocast, and that is what the checkpoint holds
    with safe_open(str(tmp_path / "full" / "last" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


@cuda_only
def test_cuda_fp32_losses_equal_the_cpu_run(make_cfg, tmp_path):
    """The same config on CPU (a subprocess with no GPU visible: accelerate's device is per process) and on the
    GPU: model init and data order come from CPU generators, so fp32 losses agree to float rounding. A tensor
    left on the wrong device, a loss normalised differently or an RNG drawn on the GPU would not."""
    gpu = make_cfg(precision="fp32", output_dir=str(tmp_path / "gpu"))
    train(gpu)
    cpu = dataclasses.replace(gpu, output_dir=str(tmp_path / "cpu"))
    code = ("import json, sys; from training.config import TrainConfig; from training.loop import train; "
            "train(TrainConfig(**json.loads(sys.argv[1])).validate())")
    path = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-c", code, json.dumps(dataclasses.asdict(cpu))], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world 1" in r.stdout and "precision fp32" in r.stdout, r.stdout[-2000:]
    g, c = read_metrics(gpu.output_dir), read_metrics(cpu.output_dir)
    assert [x["step"] for x in g] == [x["step"] for x in c]
    assert [x["loss"] for x in g] == pytest.approx([x["loss"] for x in c], abs=1e-3)
    gv, cv = [x["val_loss"] for x in g if "val_loss" in x], [x["val_loss"] for x in c if "val_loss" in x]
    assert len(gv) == 2 and gv == pytest.approx(cv, abs=1e-3)


@cuda_only
def test_checkpointing_cuts_peak_cuda_memory_with_the_same_gradients():
    """What checkpointing is for, measured where it matters: the peak of the allocator during one bf16
    forward + backward of an 8-layer model at 4 x 1024 tokens (activations >> weights)."""
    def step(checkpointing: bool) -> tuple[int, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=320, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
        model = LlamaForCausalLM(cfg).to(DEVICE)
        model.config.use_cache = False
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})  # as training.setup.get_model
        model.train()
        x = torch.randint(0, 320, (4, 1024), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        base = _reset_peak()  # the model's weights are allocated already: the peak above them is the step's
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = plain_causal_lm_loss(model, x[:, :-1], x[:, 1:]) / x[:, 1:].numel()
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
        del model, loss
        torch.cuda.empty_cache()
        return peak, grads

    step(True)  # warm-up: cuBLAS workspaces and the like are allocated once, outside either measurement
    peak_none, g_none = step(False)
    peak_full, g_full = step(True)
    assert peak_full < 0.5 * peak_none, (peak_full / 2**20, peak_none / 2**20)
    for name, g in g_none.items():
        err = float((g_full[name] - g).norm() / g.norm().clamp(min=1e-12))
        assert err < 2e-2, (name, err)


def test_resume_on_device_reproduces_uninterrupted_losses(make_cfg, tmp_path):
    full = make_cfg(precision="bf16", output_dir=str(tmp_path / "full"))
    train(full)
    expected = {r["step"]: r["loss"] for r in read_metrics(full.output_dir)}
    crashed = make_cfg(precision="bf16", output_dir=str(tmp_path / "crash"))

    def crash(step, row):
        if step == 4:  # finished but not saved (save_every=3)
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        train(crashed, on_step=crash)
    with safe_open(str(tmp_path / "crash" / "last" / "training_state.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "rng.cpu" in keys and (("rng.cuda.0" in keys) == torch.cuda.is_available()), keys
    train(crashed, resume=True)
    rows = read_metrics(crashed.output_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4, 5, 6]
    resumed = {r["step"]: r["loss"] for r in rows if r["step"] > 3}
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(expected[step], abs=2e-3), step


def test_fp16_grad_scaler_on_device(make_cfg, tmp_path):
    fp16 = train(make_cfg(precision="fp16", output_dir=str(tmp_path / "fp16")))
    rows = read_metrics(tmp_path / "fp16")
    assert all("loss_scale" in r for r in rows) and rows[0]["loss_scale"] > 1
    fp32 = train(make_cfg(precision="fp32", output_dir=str(tmp_path / "fp32")))
    assert math.isfinite(fp16["loss"]) and abs(fp16["loss"] - fp32["loss"]) < 0.3
    assert fp16["loss"] != fp32["loss"]  # autocast really ran in fp16


def test_lora_with_bf16_and_checkpointing_on_device(make_cfg, tmp_path):
    base_dir = tmp_path / "base"
    train(make_cfg(max_steps=2, output_dir=str(base_dir)))
    base = AutoModelForCausalLM.from_pretrained(base_dir / "last")
    before = {n: p.clone() for n, p in base.state_dict().items()}
    base_bytes = _reset_peak()
    lcfg = make_cfg(model_config=None, model_path=str(base_dir / "last"), lora=True, lr=1e-2, precision="bf16",
                    checkpointing="full", max_steps=8, output_dir=str(tmp_path / "lora"))
    result = train(lcfg, memory_report=True)
    rows = read_metrics(tmp_path / "lora")
    assert all(math.isfinite(r["loss"]) for r in rows)
    # the adapters learn: validation loss (fixed blocks, so less noisy than the per-batch train loss) goes down
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 3 and val[-1] < val[0], val
    rep = result["memory_report"]
    _check_report(rep, base_bytes)
    # only the adapters train: r=8 A and B for q/k/v/o of 2 layers, fp32 (64x8 + 8x{64,32,32,64}), grads too
    lora_bytes = 2 * 4 * (4 * 64 * 8 + 8 * (64 + 32 + 32 + 64))
    assert rep["gradients"] == lora_bytes and rep["optimizer_state"] >= 2 * lora_bytes, rep
    assert_lora_outputs(tmp_path / "lora", before)


@cuda_only
def test_qlora_on_cuda(make_cfg, tmp_path):
    pytest.importorskip("bitsandbytes")
    base_dir = tmp_path / "base"
    train(make_cfg(max_steps=2, output_dir=str(base_dir)))
    cfg = make_cfg(model_config=None, model_path=str(base_dir / "last"), qlora=True, lr=1e-2, precision="bf16",
                   checkpointing="full", output_dir=str(tmp_path / "qlora"))
    result = train(cfg, memory_report=True)
    assert math.isfinite(result["loss"])
    assert (tmp_path / "qlora" / "last" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "qlora" / "merged").exists()  # 4-bit bases are not merged
