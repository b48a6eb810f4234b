"""Placement: disk / CPU offload and tensor parallel give the all-in-memory model's greedy tokens; the plan's
predicted bytes match what loading materializes; bad budgets and maps are clear errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest
import torch

from memfit.errors import UserError
from memfit.runtime.slot_model import SlotModel
from serve.demo import _wait_healthy
from serve.loader import load
from serve.placement import Placement, compute_plan, measured_resident, meta_model, parse_max_memory
from tests.serve.conftest import make_model_dir
from tests.serve.conftest import slot_greedy as greedy

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
PROMPT = [5, 17, 42, 99, 3, 250, 77, 12, 8, 160, 33]


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    """4 decoder layers, so maps can split them; 4 heads / 2 KV heads, so 2-way tensor parallel divides."""
    return str(make_model_dir(tmp_path_factory.mktemp("tiny-llama-4l"), seed=3, layers=4, hidden=64))


@pytest.fixture(scope="module")
def reference(deep_dir):
    return greedy(SlotModel(load(deep_dir).model, 2, 64), PROMPT, 16)


def _map(where: list[str]) -> dict:
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    dm.update({f"model.layers.{i}": d for i, d in enumerate(where)})
    return dm


@pytest.mark.parametrize("where,prefetch", [(["disk"] * 4, True), (["disk"] * 4, False),
                                            (["cpu", "disk", "cpu", "disk"], True)])
def test_offloaded_layers_give_the_same_greedy_tokens(deep_dir, reference, where, prefetch):
    loaded = load(deep_dir, placement=Placement(_map(where), prefetch=prefetch), max_batch=2, max_seq_len=64)
    sm = SlotModel(loaded.model, 2, 64, prefetch=prefetch)
    assert sm.prefetch.offloaded == [i for i, d in enumerate(where) if d == "disk"]
    assert greedy(sm, PROMPT, 16) == reference
    # offloaded weights are back on meta after the step, but for the next step's first layer when prefetching
    for fut in sm.prefetch.pending.values():
        fut.result()
    resident = [i for i, d in enumerate(where) if d == "disk"
                if not any(p.is_meta for p in loaded.model.model.layers[i].parameters())]
    assert resident == ([where.index("disk")] if prefetch else []), resident


def test_an_offloaded_embedding_counts_in_the_working_bytes():
    """An embedding (or lm_head) on disk is materialized whole while it runs, like an offloaded layer: on Gemma 3
    270M its 640 MiB vocabulary is that much more than the largest layer the plan used to count (a fit candidate
    predicted 1.1 GiB and measured 1.7 GiB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    embed = meta.model.embed_tokens.weight.numel() * 4
    layer = sum(p.numel() * 4 for p in meta.model.layers[0].parameters())
    assert embed > 4 * layer
    plan = compute_plan(meta, _map(["disk"] * 4) | {"model.embed_tokens": "disk"}, None, 2, 64, torch.float32)
    assert plan.working["cpu"] == embed
    assert compute_plan(meta, _map(["disk"] * 4), None, 2, 64, torch.float32).working["cpu"] == layer


def test_max_memory_budget_offloads_and_plan_matches_loading(deep_dir, reference):
    meta = meta_model(deep_dir, torch.float32)
    layer = sum(p.numel() * 4 for p in meta.model.layers[0].parameters())
    embed = meta.model.embed_tokens.weight.numel() * 4
    kv = 2 * 2 * 2 * 64 * 16 * 4 * 4  # k+v, batch 2, 2 KV heads, 64 positions, head_dim 16, fp32, 4 layers
    budget = embed + kv + 3 * layer + layer // 2  # room for 1 resident layer + 2 working (prefetch) layers
    mm = {"cpu": budget}
    plan = compute_plan(meta, "auto", mm, 2, 64, torch.float32)
    on_disk = [m.name for m in plan.modules if m.device == "disk" and "layers" in m.name]
    assert 1 <= len(on_disk) < 4, plan.device_map
    assert plan.resident["cpu"] + plan.working["cpu"] <= budget
    loaded = load(deep_dir, placement=Placement("auto", mm), max_batch=2, max_seq_len=64)
    sm = SlotModel(loaded.model, 2, 64)
    measured = measured_resident(loaded.model, sm.cache_bytes_per_device())
    assert abs(measured["cpu"] - plan.resident["cpu"]) <= 0.1 * plan.resident["cpu"], (measured, plan.resident)
    assert greedy(sm, PROMPT, 16) == reference
    for fut in sm.prefetch.pending.values():
        fut.result()
    after = measured_resident(loaded.model, sm.cache_bytes_per_device())["cpu"]
    assert after <= plan.resident["cpu"] + plan.working["cpu"], (after, plan)
    # all in RAM: the plan's bytes are what loading materializes too
    full = compute_plan(meta, "cpu", None, 2, 64, torch.float32)
    sm_full = SlotModel(load(deep_dir).model, 2, 64)
    got = measured_resident(sm_full.hf, sm_full.cache_bytes_per_device())["cpu"]
    assert abs(got - full.resident["cpu"]) <= 0.1 * full.resident["cpu"], (got, full.resident)


def test_budget_too_small_for_one_layer_is_a_clear_error(deep_dir):
    with pytest.raises(UserError, match="too small: running needs at least one decoder layer"):
        compute_plan(meta_model(deep_dir, torch.float32), "auto", {"cpu": 10_000}, 2, 64, torch.float32)
    r = subprocess.run([sys.executable, "-m", "serve", "--model", deep_dir, "--max-memory", "cpu=10KB"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "too small" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "serve", "plan", deep_dir, "--max-memory", "cpu=10KB"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "too small" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("text,needle", [("cpu:48GiB", "not DEVICE=SIZE"), ("tpu=1GiB", "unknown device"),
                                         ("cpu=lots", "not a size"), ("cuda:0=1GiB", "CUDA device")])
def test_bad_max_memory(text, needle):
    if needle == "CUDA device" and torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(UserError, match=needle):
        parse_max_memory(text)


def test_device_map_file_and_bad_file(deep_dir, reference, tmp_path):
    good = tmp_path / "map.json"
    good.write_text(json.dumps(_map(["cpu", "cpu", "disk", "disk"])))
    r = subprocess.run([sys.executable, "-m", "serve", "plan", deep_dir, "--device-map", str(good), "--json",
                        "--max-batch", "2", "--max-seq-len", "64"], capture_output=True, text=True, timeout=120,
                       env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    assert plan["device_map"]["model.layers.3"] == "disk" and plan["modules_per_device"]["disk"] == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "gpu7"}))
    r = subprocess.run([sys.executable, "-m", "serve", "--model", deep_dir, "--device-map", str(bad)],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "gpu7" in r.stderr, r.stderr[-2000:]


def _env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ") as f:
        return dict(kv.split("=", 1) for kv in f.read().split("\0") if "=" in kv)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensor_parallel_2_ranks_over_gloo_serves_the_same_greedy_tokens(deep_dir, reference):
    port = _port()
    # --standalone: torchrun picks its own free rendezvous port (a port we pick can be taken before it binds)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    p = subprocess.Popen([*torchrun, "-m", "serve", "--model", deep_dir, "--tp", "2", "--port", str(port),
                          "--max-batch", "2", "--max-seq-len", "64", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                         start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, p, timeout=180)
        except RuntimeError as e:
            raise AssertionError(f"{e}\n{p.stdout.read()[-3000:] if p.poll() is not None else ''}") from None
        health = httpx.get(url + "/health", timeout=5).json()
        assert health["placement"]["tp"] == 2
        # half the KV heads per rank: rank 0's cache is half the single-process one
        assert health["placement"]["kv_cache_bytes"]["cpu"] == 2 * 2 * 1 * 64 * 16 * 4 * 4
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": deep_dir, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "logprobs": 0})
        assert r.status_code == 200, r.text
        tokens = r.json()["choices"][0]["logprobs"]["tokens"]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(deep_dir)
        assert tokens == [tok.decode([t], skip_special_tokens=False) for t in reference]
        # SIGTERM to rank 0 (as a pod would to the serving process): it drains, stops the workers, all exit 0
        pids = [int(x) for x in subprocess.run(["pgrep", "-f", "--", f"--port {port}"], capture_output=True,
                                                text=True).stdout.split()]
        ranks = [pid for pid in pids if pid != p.pid and _env(pid).get("RANK") == "0"]
        assert len(ranks) == 1, pids
        os.kill(ranks[0], signal.SIGTERM)
        assert p.wait(60) == 0, p.stdout.read()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_compress_output_places_the_same_way(deep_dir, tmp_path):
    from compress.cli import main as compress_main

    out = tmp_path / "q4"
    assert compress_main(["quantize", deep_dir, "-o", str(out), "--bits", "4", "--method", "rtn",
                          "--group-size", "32"]) == 0
    ref = greedy(SlotModel(load(str(out)).model, 2, 64), PROMPT, 12)
    loaded = load(str(out), placement=Placement("auto", {"cpu": 300_000}, offload_folder=str(tmp_path / "off")),
                  max_batch=2, max_seq_len=64)
    sm = SlotModel(loaded.model, 2, 64)
    assert loaded.quantized == "compress" and len(sm.prefetch.offloaded) >= 2
    assert greedy(sm, PROMPT, 12) == ref


def test_plan_predicts_the_paged_kv_cache(model_dir, capsys):
    from serve.plan import main as plan_main

    # the tiny model: 512 bytes a token, 8KiB a block of 16; 1MiB = 128 blocks = 2048 tokens
    assert plan_main([model_dir, "--max-seq-len", "256", "--kv-cache-memory", "1MiB", "--seq-len", "100",
                      "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv"]
    assert (kv["blocks"], kv["tokens"], kv["bytes_per_block"]) == (128, 2048, 8192)
    assert kv["sequences_fit"] == 128 // 7 and kv["running_at_once"] == 16 and kv["static_slots_same_bytes"] == 8
    # int8 KV: 160 bytes a token, 2560 a block: 409 blocks in 1MiB
    assert plan_main([model_dir, "--max-seq-len", "256", "--kv-cache-memory", "1MiB", "--kv-cache-dtype", "int8",
                      "--json"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv"]
    assert (kv["blocks"], kv["bytes_per_block"], kv["static_slots_same_bytes"]) == (409, 2560, 25)
    assert plan_main([model_dir, "--max-seq-len", "256", "--kv-cache-memory", "64KiB"]) == 2
    assert "one --max-seq-len 256 sequence needs 16" in capsys.readouterr().err
