"""`compress export --format gguf` (compress/gguf_export.py): files gguf-py reads back to our weights (bit-exact
where memfit's codes are mapped), metadata as llama.cpp's convert_hf_to_gguf.py writes it (Gemma 3 against its
original GGUF), bad input refused with exit 2 and no file; and, where llama.cpp's llama-server is built
(`python bench/peers.py install --only llamacpp`), its greedy tokens against memfit's on the same prompt ids."""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import signal
import socket
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from compress import ctformat, gguf_export
from compress.cli import main
from compress.store import WeightSource
from memfit.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SHAKES = ROOT / "models" / "shakespeare-llama"
GEMMA = ROOT / ".cache" / "models" / "gemma3-270m"
GEMMA_REF = ROOT / ".cache" / "gguf" / "gemma-3-270m-q4_k_m.gguf"
LLAMA_SERVER = ROOT / ".cache" / "peers" / "llamacpp" / "bin" / "llama-server"
Q = gguf.GGMLQuantizationType
no_gemma = pytest.mark.skipif(not (GEMMA / "config.json").is_file(), reason="make real-model not run")
no_server = pytest.mark.skipif(not LLAMA_SERVER.is_file(), reason="llama-server not built (bench/peers.py install)")


def export(*args: Any) -> int:
    return main(["export", *map(str, args)])


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_expected(name: str, w: torch.Tensor) -> torch.Tensor:
    """shakespeare-llama (8 heads, 4 KV heads): the Q/K rows in llama.cpp's RoPE order."""
    return permute(w, 8) if ".q_proj." in name else permute(w, 4) if ".k_proj." in name else w


def read_tensors(path: Path) -> dict[str, tuple[Q, np.ndarray]]:
    """GGUF tensor name -> (type, raw data as rows of bytes / values), by gguf.GGUFReader."""
    r = gguf.GGUFReader(path)
    return {t.name: (Q(t.tensor_type), np.asarray(t.data)) for t in r.tensors}


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[Q, tuple[int, ...], np.ndarray]]]:
    """Metadata and tensors (type, torch-order shape, raw bytes) of a GGUF file. gguf.GGUFReader takes ~15 s on a
    262,144-token vocabulary (a field object per array item); this reads the same layout in well under one."""
    fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    pos = 0

    def take(code: str) -> Any:
        nonlocal pos
        (v,) = struct.unpack_from("<" + code, mm, pos)
        pos += struct.calcsize("<" + code)
        return v

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return bytes(mm[pos - n:pos]).decode("utf-8", errors="replace")

    def value(t: int) -> Any:
        nonlocal pos
        if t == 8:
            return string()
        if t != 9:
            return take(fmt[t])
        et, n = take("I"), take("Q")
        if et == 8:
            return [string() for _ in range(n)]
        a = np.frombuffer(mm, dtype=np.dtype("<" + fmt[et]), count=n, offset=pos).copy()
        pos += a.nbytes
        return a.tolist()

    assert take("I") == 0x46554747  # "GGUF"
    take("I")
    n_tensors, n_kv = take("Q"), take("Q")
    kv = {}
    for _ in range(n_kv):
        key = string()
        kv[key] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, tuple(reversed(dims)), Q(take("I")), take("Q")))
    align = kv.get("general.alignment", 32)
    start = -(-pos // align) * align
    tensors = {}
    for name, shape, t, off in infos:
        block, size = gguf.GGML_QUANT_SIZES[t]
        raw = np.frombuffer(mm, dtype=np.uint8, count=math.prod(shape) // block * size, offset=start + off)
        tensors[name] = (t, shape, raw.reshape(shape[0], -1) if len(shape) == 2 else raw)
    return kv, tensors


def dequant(t: Q, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, t)


# --- (1) plain HF dir -> f16 / q8_0 / q4_0 ---------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_llama_export_reads_back_to_our_weights(tmp_path: Path, qtype: str, capsys) -> None:
    out = tmp_path / f"s-{qtype}.gguf"
    assert export(SHAKES, "-o", out, "--type", qtype) == 0
    assert "wrote" in capsys.readouterr().out
    r = gguf.GGUFReader(out)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert {k: kv[k] for k in kv if k.startswith("llama.")} == {
        "llama.block_count": 6, "llama.context_length": 1024, "llama.embedding_length": 256,
        "llama.feed_forward_length": 704, "llama.attention.head_count": 8, "llama.attention.head_count_kv": 4,
        "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        "llama.attention.key_length": 32, "llama.attention.value_length": 32, "llama.vocab_size": 4096,
        "llama.rope.dimension_count": 32}
    assert kv["general.architecture"] == "llama" and kv["general.file_type"] == {
        "f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2}[qtype]
    tok = json.loads((SHAKES / "tokenizer.json").read_text())
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "gpt-2"
    assert len(kv["tokenizer.ggml.tokens"]) == 4096 and len(kv["tokenizer.ggml.merges"]) == len(tok["model"]["merges"])
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert kv["tokenizer.ggml.add_bos_token"] is False  # the HF tokenizer adds none either
    got = {t.name: t for t in r.tensors}
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 6)
    hf = load_file(SHAKES / "model.safetensors")
    assert "output.weight" not in got and len(got) == len(hf)  # tied: token_embd serves as output
    for name, w in hf.items():
        t = got[tmap.get_name(name, try_suffixes=(".weight",))]
        x = llama_expected(name, w.float()).numpy()
        if w.dim() == 1:  # norms stay f32
            assert t.tensor_type == Q.F32 and np.array_equal(t.data, x)
            continue
        want = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[qtype]
        if qtype == "q4_0" and t.name == "token_embd.weight":
            want = Q.Q8_0  # tied embedding = output: llama-quantize gives it Q6_K, gguf-py's nearest is Q8_0
        assert t.tensor_type == want, t.name
        # the very bytes gguf.quants makes of our weights (f16: x.astype(float16), fp16 rounding)
        assert np.asarray(t.data).tobytes() == gguf.quants.quantize(x, want).tobytes(), t.name
        if want in (Q.Q8_0, Q.Q4_0):
            err = np.abs(dequant(want, np.asarray(t.data)) - x).max() / np.abs(x).max()
            assert err < (0.01 if want == Q.Q8_0 else 0.15), (t.name, err)


# --- (2) memfit output -> mapped blocks ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for sym in ("sym", "asym"):
        dirs[sym] = tmp_path_factory.mktemp("q4") / sym
        assert main(["quantize", str(SHAKES), "-o", str(dirs[sym]), "--bits", "4", "--method", "rtn",
                     "--group-size", "32", f"--{sym}"]) == 0
    return dirs


def memfit_layers(path: Path):
    """(module name, memfit's Quantized) of every quantized Linear, read with compress's own format code."""
    src = WeightSource(path)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    mods = [k.removesuffix(".weight_packed") for k in src.keys() if k.endswith(".weight_packed")]
    for mod, args in ctformat.parse_config(qc, mods).items():
        yield mod, ctformat.read_quantized(src.get, mod, args)


@pytest.mark.parametrize("sym,qtype,want,how", [
    ("sym", "auto", Q.Q4_0, "mapped"), ("sym", "q8_0", Q.Q8_0, "mapped"), ("sym", "q4_1", Q.Q4_1, "mapped"),
    ("asym", "auto", Q.Q4_1, "mapped"), ("asym", "q4_0", Q.Q4_0, "requantized"), ("asym", "f16", Q.F16, "dequantized"),
])
def test_memfit_output_maps_onto_gguf_blocks(q4, tmp_path: Path, sym: str, qtype: str, want: Q, how: str,
                                              capsys) -> None:
    out = tmp_path / "m.gguf"
    assert export(q4[sym], "-o", out, "--type", qtype) == 0
    text = capsys.readouterr().out
    assert f"attn_q.weight                {want.name:<5} {how:<12} 6" in text
    assert "requantized: memfit codes dequantized" in text  # the rule is stated in the summary
    got = read_tensors(out)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 6)
    layers = list(memfit_layers(q4[sym]))
    assert len(layers) == 42
    for mod, q in layers:
        t, raw = got[tmap.get_name(mod + ".weight", try_suffixes=(".weight",))]
        ref = llama_expected(mod + ".weight", q.dequantize()).numpy()  # memfit's weights, fp32: (q - z) * s
        assert t == want, mod
        deq = dequant(t, raw)
        if how == "requantized":
            assert np.array_equal(raw, gguf.quants.quantize(ref, want)), mod
        elif want == Q.F16:
            assert np.array_equal(deq, ref.astype(np.float16).astype(np.float32)), mod
        elif sym == "sym":  # Q4_0 / Q8_0 / Q4_1 with m = -8 s: bit-exact
            assert np.array_equal(deq, ref), mod
        else:  # Q4_1 of an asymmetric group: m = -z s rounded to fp16, the only rounding
            zs = llama_expected(mod + ".weight", (q.zero.float() * q.scale.float()).repeat_interleave(32, 1)).numpy()
            assert (np.abs(deq - ref) <= np.abs(zs) * 2.0**-11 + 1e-7).all(), mod
            assert not np.array_equal(deq, ref)  # (it does round somewhere)


def test_three_bit_symmetric_maps_exactly_onto_q4_0(tmp_path: Path, capsys) -> None:
    """A 3-bit symmetric code q - 4 lies in Q4_0's [-8, 7]: mapped losslessly; group 64 = two blocks of 32."""
    q3 = tmp_path / "q3"
    assert main(["quantize", str(SHAKES), "-o", str(q3), "--bits", "3", "--method", "rtn", "--group-size", "64",
                 "--sym"]) == 0
    assert export(q3, "-o", tmp_path / "q3.gguf") == 0
    assert "ffn_down.weight              Q4_0  mapped       6" in capsys.readouterr().out
    got = read_tensors(tmp_path / "q3.gguf")
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 6)
    for mod, q in memfit_layers(q3):
        t, raw = got[tmap.get_name(mod + ".weight", try_suffixes=(".weight",))]
        assert np.array_equal(dequant(t, raw), llama_expected(mod + ".weight", q.dequantize()).numpy()), mod


# --- (3) bad input ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["type", "arch", "missing", "not_model", "exists", "suffix", "is_dir"])
def test_bad_input_exits_2_and_writes_nothing(tmp_path: Path, case: str, capsys) -> None:
    model, out, extra = SHAKES, tmp_path / "out.gguf", []
    if case == "type":
        extra = ["--type", "q4_k_m"]
    elif case == "arch":
        model = tmp_path / "gpt2"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        save_file({"wte.weight": torch.zeros(4, 4)}, str(model / "model.safetensors"))
    elif case == "missing":
        model = tmp_path / "nope"
    elif case == "not_model":
        model = tmp_path / "empty"
        model.mkdir()
    elif case == "exists":
        out.write_bytes(b"old")
    elif case == "suffix":
        out = tmp_path / "out.bin"
    else:
        out.mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert export(model, "-o", out, *extra) == 2
    err = capsys.readouterr().err
    assert {"type": "invalid choice", "arch": "model_type 'gpt2' is not supported", "missing": "not a directory",
            "not_model": "no config.json", "exists": "already exists", "suffix": "ending in .gguf",
            "is_dir": "is a directory"}[case] in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    if case == "exists":
        assert out.read_bytes() == b"old"


def test_failure_midway_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    calls = []

    def boom(data: np.ndarray, qtype: Q) -> np.ndarray:
        calls.append(qtype)
        if len(calls) == 20:
            raise RuntimeError("disk on fire")
        return gguf.quants.quantize(data, qtype)

    monkeypatch.setattr(gguf_export.gguf.quants, "quantize", boom)
    (tmp_path / "out.gguf").write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk on fire"):
        gguf_export.export(SHAKES, tmp_path / "out.gguf", "q8_0", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out.gguf"] and (tmp_path / "out.gguf").read_bytes() == b"old"


def test_pruned_output_is_written_dense_and_low_rank_refused(tmp_path: Path, capsys) -> None:
    from compress import sparse_store

    assert main(["prune", str(SHAKES), "-o", str(tmp_path / "p"), "--method", "magnitude", "--pattern", "2:4"]) == 0
    assert export(tmp_path / "p", "-o", tmp_path / "p.gguf", "--type", "f16") == 0
    got = read_tensors(tmp_path / "p.gguf")
    src = WeightSource(tmp_path / "p")
    w = sparse_store.read_sparse(src.get, "model.layers.2.mlp.down_proj").float().numpy()
    t, raw = got["blk.2.ffn_down.weight"]
    assert t == Q.F16 and np.array_equal(raw, w.astype(np.float16)) and (raw == 0).mean() == 0.5
    assert main(["lowrank", str(SHAKES), "-o", str(tmp_path / "lr"), "--method", "svd", "--ratio", "0.5"]) == 0
    capsys.readouterr()
    assert export(tmp_path / "lr", "-o", tmp_path / "lr.gguf") == 2
    assert "low-rank layers" in capsys.readouterr().err and not (tmp_path / "lr.gguf").exists()


def tiny_arch(dest: Path, kind: str) -> Path:
    """A random 2-layer qwen2 (q/k/v biases, tied) or mistral (untied) dir with shakespeare-llama's tokenizer."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=kind == "qwen2",
               bos_token_id=1, eos_token_id=2, initializer_range=0.1)  # wide logits: few near ties
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)) if kind == "qwen2" else MistralForCausalLM(MistralConfig(**cfg))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    model.save_pretrained(dest)
    for f in SHAKES.glob("tokenizer*"):
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_qwen2_and_mistral_follow_convert_hf_to_gguf(tmp_path: Path, kind: str) -> None:
    """qwen2: its own arch, biases f32, Q/K as stored (NEOX RoPE); mistral: llama, Q/K permuted, output kept."""
    model = tiny_arch(tmp_path / kind, kind)
    assert export(model, "-o", tmp_path / "t.gguf", "--type", "f32") == 0
    r = gguf.GGUFReader(tmp_path / "t.gguf")
    arch = r.fields["general.architecture"].contents()
    assert arch == {"qwen2": "qwen2", "mistral": "llama"}[kind]
    got = {t.name: np.asarray(t.data) for t in r.tensors}
    hf = load_file(model / "model.safetensors")
    q = hf["model.layers.1.self_attn.q_proj.weight"]
    assert np.array_equal(got["blk.1.attn_q.weight"], (q if kind == "qwen2" else permute(q, 4)).numpy())
    if kind == "qwen2":
        assert np.array_equal(got["blk.1.attn_k.bias"], hf["model.layers.1.self_attn.k_proj.bias"].numpy())
        assert "output.weight" not in got and "qwen2.vocab_size" not in r.fields
    else:
        assert np.array_equal(got["output.weight"], hf["lm_head.weight"].numpy())


@pytest.mark.parametrize("change,message", [
    ({"query_pre_attn_scalar": 128}, "query_pre_attn_scalar 128"),
    ({"layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 4 + ["sliding_attention"] * 2},
     "layer_types differ"),
    ({"attn_logit_softcapping": 50.0}, "softcapping"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
])
def test_gemma3_configs_llama_cpp_would_run_differently_are_refused(change: dict, message: str) -> None:
    cfg = {"num_attention_heads": 4, "hidden_size": 640, "num_hidden_layers": 18, "head_dim": 256,
           "max_position_embeddings": 32768, "intermediate_size": 2048, "num_key_value_heads": 1,
           "query_pre_attn_scalar": 256, "sliding_window": 512, "rope_parameters": {
               "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
               "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}}
    w = gguf.GGUFWriter(None, "gemma3")
    assert gguf_export.add_hparams(w, "gemma3", cfg, 262144) == []  # as is: accepted
    with pytest.raises(UserError, match=message):
        gguf_export.add_hparams(gguf.GGUFWriter(None, "gemma3"), "gemma3", {**cfg, **change}, 262144)


# --- (4) Gemma 3 270M against its original GGUF ----------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_q8(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gemma") / "gemma3-270m-q8_0.gguf"
    assert export(GEMMA, "-o", out, "--type", "q8_0") == 0  # ~15 s on 2 cores
    return out


@no_gemma
@pytest.mark.skipif(not GEMMA_REF.is_file(), reason="the original Gemma 3 270M GGUF is missing")
def test_gemma3_metadata_matches_the_original_gguf(gemma_q8: Path) -> None:
    ours, tensors = read_gguf(gemma_q8)
    ref, _ = read_gguf(GEMMA_REF)
    keys = {k for k in ours if k.startswith(("gemma3.", "tokenizer."))}
    ref_keys = {k for k in ref if k.startswith(("gemma3.", "tokenizer."))}
    # today's convert_hf_to_gguf.py writes both; the original file predates them (llama.cpp defaults to 10000)
    assert keys - ref_keys == {"gemma3.rope.freq_base_swa", "tokenizer.ggml.mask_token_id"} and ref_keys <= keys
    assert ours["gemma3.rope.freq_base_swa"] == 10000.0 and ours["tokenizer.ggml.mask_token_id"] == 4
    for k in sorted(ref_keys - {"tokenizer.ggml.scores"}):
        assert ours[k] == ref[k], k  # hyper-parameters, special ids, add_* flags, tokens, token types
    # SentencePiece scores: the same order (all llama.cpp's tokenizer compares), not the original's values
    s, r = np.array(ours["tokenizer.ggml.scores"]), np.array(ref["tokenizer.ggml.scores"])
    assert np.array_equal(np.argsort(-s, kind="stable"), np.argsort(-r, kind="stable"))
    assert ours["general.architecture"] == "gemma3" and ours["general.file_type"] == 7
    assert "output.weight" not in tensors  # tied
    t, shape, raw = tensors["token_embd.weight"]
    assert (t, shape) == (Q.Q8_0, (262144, 640))
    hf = WeightSource(GEMMA)
    for name, key in [("output_norm.weight", "model.norm.weight"),
                      ("blk.3.attn_q_norm.weight", "model.layers.3.self_attn.q_norm.weight")]:
        t, _, raw = tensors[name]  # Gemma's RMSNorm multiplies by 1 + w: stored as 1 + w, f32
        assert t == Q.F32 and np.array_equal(raw.view(np.float32), hf.get(key).float().numpy() + 1.0)
    t, _, raw = tensors["blk.0.attn_q.weight"]  # no RoPE permutation for gemma3 (NEOX layout in llama.cpp)
    w = hf.get("model.layers.0.self_attn.q_proj.weight").float().numpy()
    assert t == Q.Q8_0 and np.array_equal(raw, gguf.quants.quantize(w, Q.Q8_0))


# --- (5) llama.cpp's llama-server: greedy tokens against memfit's ----------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def llama_server(model: Path, log: Path) -> Iterator[str]:
    """llama-server on model (flags as in bench/peers.py, one slot, 2 threads); yields its base URL."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as f:
        proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                                 "-c", "512", "-np", "1", "-t", "2", "-tb", "2", "--no-webui"],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(600):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def complete(base: str, ids: list[int], n: int) -> list[int]:
    """llama.cpp's greedy tokens after ids (an id prompt is used as given: no BOS added), EOS ignored."""
    body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": False,
            "ignore_eos": True, "return_tokens": True}
    return _post(base, "/completion", body)["tokens"]


def memfit_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    """memfit's greedy tokens (EOS suppressed, like ignore_eos) and its top-2 logit margin at each step."""
    from compress.loader import load

    quantized = "quantization_config" in json.loads((model_dir / "config.json").read_text())
    model = load(model_dir, backend="dequant") if quantized else load(model_dir)  # dequant: the fp32 reference
    out = []
    with torch.inference_mode():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               output_scores=True, return_dict_in_generate=True)
            top = torch.stack(g.scores)[:, 0].topk(2, -1).values
            out.append((g.sequences[0, len(p):].tolist(), (top[:, 0] - top[:, 1]).tolist()))
    return out


TIE = 0.05  # logits: a step where memfit's top two are closer is a tie llama.cpp's arithmetic may break otherwise


def check_server(model_dir: Path, gguf_file: Path, tmp_path: Path, texts: list[str], exact: bool,
                 n: int = 16) -> None:
    """llama.cpp's tokenizer gives the HF ids (BOS as HF adds it); its greedy tokens are memfit's: all n of them
    (exact), and, fed memfit's tokens so far, its next token at every step that is not a tie (< TIE apart).

    Ties do occur: memfit's 4-bit output of shakespeare-llama (Q4_0 blocks bit-exact) has its top two 0.001
    apart at step 3 of the second prompt, Gemma 3 at q8_0 0.014 apart at step 12 of the first; summation order
    alone breaks the first either way, and llama.cpp multiplies Q4_0/Q8_0 weights with activations quantized
    to 8 bits. A free-running comparison parts there for good. By hand: Gemma's f32 export gives all 16 tokens
    of both prompts; memfit's 4-bit Gemma as Q4_0 parts at margins 0.14 and 0.17 (Gemma's large activations
    and 8-bit activation blocks), and gives all 32 once llama-quantize has dequantized its blocks to F32."""
    from memfit.hf import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    prompts = [tok(t).input_ids for t in texts]
    ref = memfit_greedy(model_dir, prompts, n)
    with llama_server(gguf_file, tmp_path / f"{gguf_file.stem}.log") as base:
        for text, ids in zip(texts, prompts, strict=True):
            assert _post(base, "/tokenize", {"content": text, "add_special": True})["tokens"] == ids
        for ids, (want, margin) in zip(prompts, ref, strict=True):
            if exact:
                assert complete(base, ids, n) == want
            steps = [complete(base, ids + want[:i], 1)[0] for i in range(n)]
            off = [i for i in range(n) if steps[i] != want[i] and margin[i] >= TIE]
            assert not off, (off, steps, want, [round(m, 3) for m in margin])


SHAKES_PROMPTS = ["ROMEO:\nBut soft, what light through yonder window breaks?", "First Citizen:\nBefore we proceed"]


@no_server
@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_llama_server_greedy_matches_memfit(tmp_path: Path, qtype: str) -> None:
    out = tmp_path / f"shakespeare-{qtype}.gguf"
    assert export(SHAKES, "-o", out, "--type", qtype) == 0
    check_server(SHAKES, out, tmp_path, SHAKES_PROMPTS, exact=True)


@no_server
def test_llama_server_greedy_matches_memfit_on_mapped_q4_0(q4, tmp_path: Path) -> None:
    out = tmp_path / "shakespeare-q4sym.gguf"
    assert export(q4["sym"], "-o", out) == 0  # auto: Q4_0 blocks = memfit's codes
    check_server(q4["sym"], out, tmp_path, SHAKES_PROMPTS, exact=False)
    # llama.cpp's own reading of the blocks (llama-quantize dequantizes them to F32): memfit's weights, bit-exact
    f32 = tmp_path / "shakespeare-q4sym-f32.gguf"
    subprocess.run([str(LLAMA_SERVER.with_name("llama-quantize")), "--allow-requantize", str(out), str(f32), "F32",
                    "2"], check=True, capture_output=True)
    got = read_tensors(f32)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 6)
    for mod, q in memfit_layers(q4["sym"]):
        t, raw = got[tmap.get_name(mod + ".weight", try_suffixes=(".weight",))]
        assert t == Q.F32 and np.array_equal(raw, llama_expected(mod + ".weight", q.dequantize()).numpy()), mod


@no_server
@no_gemma
def test_llama_server_greedy_matches_hf_on_gemma3(gemma_q8: Path, tmp_path: Path) -> None:
    check_server(GEMMA, gemma_q8, tmp_path, ["The capital of France is", "def fibonacci(n):\n    "], exact=False)


@no_server
@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_llama_server_greedy_matches_hf_on_qwen2_and_mistral(tmp_path: Path, kind: str) -> None:
    model = tiny_arch(tmp_path / kind, kind)
    assert export(model, "-o", tmp_path / f"{kind}.gguf", "--type", "f32") == 0
    check_server(model, tmp_path / f"{kind}.gguf", tmp_path, SHAKES_PROMPTS, exact=True)
