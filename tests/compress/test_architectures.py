"""compress on the decoder architectures serve runs, beyond Llama: tiny random gemma3_text (sliding + full
layers, GELU-gated MLP, (1 + w) RMSNorms, pre/post-feedforward norms), qwen3 (q/k norms), phi3 (fused qkv_proj
and gate_up_proj) and gpt_neox (LayerNorm with bias, fused head-interleaved query_key_value, plain GELU MLP,
parallel residual); gpt2 (Conv1D layers compressed as Linears).

Each is quantized to 4 bits with rtn, gptq and awq; the output must load in plain transformers
(compressed-tensors) and in compress.load with the same logits, and stay close to the fp32 model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPTNeoXConfig,
    Phi3Config,
    Qwen3Config,
)

import compress
from compress import awq, awqfold
from compress.calib import eval_tokens
from compress.cli import main
from compress.evaluate import kl_against, kl_reference
from compress.layerjob import LayerJob
from compress.loader import load
from compress.quant import QuantArgs
from memfit.hf import load_tokenizer

from .conftest import fake_text, logits, make_tokenizer

CAL = ["--calib-samples", "4", "--calib-seqlen", "32"]
# Mean per-token KL(fp32 || 4-bit) over 4 x 48 eval tokens, measured on this file's models (group 128, asym):
#   gemma3_text rtn 0.0327 gptq 0.0116 awq 0.0159 | qwen3 rtn 0.166 gptq 0.0534 awq 0.104
#   phi3        rtn 0.195  gptq 0.0595 awq 0.134  | gpt_neox rtn 0.0441 gptq 0.0099 awq 0.0243
#   gpt2        rtn 0.00056 gptq 0.00029 awq 0.00045 (HF's default initializer_range 0.02: smaller weights)
# Random weights (initializer_range 0.1, no structure to exploit) make these large next to a trained model's.
# RTN is deterministic: 2x its measured KL catches a walk that loads or stores the wrong tensors (a wrong fold,
# a wrong mask, a misplaced lm_head give KLs of order 1 and more). GPTQ and AWQ must beat RTN's measured
# value (they did by 2-4x and 1.3-2x); AWQ may not exceed this run's RTN by more than calibration noise.
RTN_KL = {"gemma3_text": 0.0327, "qwen3": 0.166, "phi3": 0.195, "gpt_neox": 0.0441, "gpt2": 0.00056}
AWQ_NOISE = 1.1

def _common(tok) -> dict:
    return {"vocab_size": 320, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 256, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "initializer_range": 0.1}


def _config(arch: str, tok):
    c = _common(tok)
    if arch == "gemma3_text":
        return Gemma3TextConfig(**c, intermediate_size=256, num_key_value_heads=2, head_dim=32, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**c, intermediate_size=256, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    if arch == "phi3":
        return Phi3Config(**c, intermediate_size=256, num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "gpt_neox":
        return GPTNeoXConfig(**c, intermediate_size=512, rotary_pct=0.25, use_parallel_residual=True,
                             tie_word_embeddings=False)
    if arch == "gpt2":
        return GPT2Config(vocab_size=320, n_embd=128, n_layer=2, n_head=4, n_positions=256,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    raise AssertionError(arch)


def make_arch_dir(dest: Path, arch: str) -> Path:
    """A tiny random `arch` model dir with a BPE tokenizer. Norm weights are random with a few large input
    channels (as trained LMs have, and so that a Gemma (1 + w) norm differs from a w norm)."""
    tok = make_tokenizer(fake_text(3000, seed=1))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch, tok)).eval()
    one = 0.0 if arch == "gemma3_text" else 1.0  # Gemma's norms multiply by 1 + w
    with torch.no_grad():
        for name, m in model.named_modules():
            w = getattr(m, "weight", None)
            if "norm" not in type(m).__name__.lower() or not isinstance(w, torch.Tensor) or w.dim() != 1:
                continue
            w.copy_(one + 0.3 * torch.randn_like(w))
            if name.endswith(("input_layernorm", "pre_feedforward_layernorm")) or (
                    arch != "gemma3_text" and name.endswith("post_attention_layernorm")):
                w[:4] = one + 7.0
            b = getattr(m, "bias", None)
            if isinstance(b, torch.Tensor):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


ARCHS = ("gemma3_text", "qwen3", "phi3", "gpt_neox")


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory) -> dict[str, Path]:
    return {a: make_arch_dir(tmp_path_factory.mktemp(a) / "fp", a) for a in ARCHS}


@pytest.fixture(scope="module")
def eval_ids(arch_dirs, eval_file: Path) -> torch.Tensor:
    return eval_tokens(load_tokenizer(str(arch_dirs["qwen3"])), [eval_file])[: 4 * 48].view(4, 48)


def _quantize(src: Path, out: Path, method: str, calib_file: Path) -> None:
    calib = ["--calib", str(calib_file), *CAL] if method != "rtn" else []
    assert main(["quantize", str(src), "-o", str(out), "--bits", "4", "--method", method, *calib]) == 0


@pytest.fixture(scope="module")
def kls(arch_dirs, eval_ids, calib_file: Path, tmp_path_factory) -> dict[tuple[str, str], float]:
    """Quantize every architecture with every method; check the loads agree; the KL of each to fp32."""
    out: dict[tuple[str, str], float] = {}
    for arch, fp_dir in arch_dirs.items():
        fp = AutoModelForCausalLM.from_pretrained(fp_dir, dtype=torch.float32).eval()
        ref = kl_reference(fp, eval_ids.flatten(), 48)
        for method in ("rtn", "gptq", "awq"):
            q = tmp_path_factory.mktemp(f"{arch}-{method}") / "q"
            _quantize(fp_dir, q, method, calib_file)
            hf = AutoModelForCausalLM.from_pretrained(q, dtype=torch.float32).eval()  # compressed-tensors
            ours = load(q, backend="dequant")  # compress.load with the exact fp32 reference format
            theirs, mine = logits(hf, eval_ids), logits(ours, eval_ids)
            assert torch.allclose(mine, theirs, atol=1e-4 * float(theirs.abs().max()), rtol=0), (arch, method)
            fast = logits(compress.load(q), eval_ids)  # the default: int4 kernel, bf16 activations (~0.4% per
            assert (fast - theirs).abs().mean() < 5e-2 * theirs.abs().mean(), (arch, method)  # Linear, grows)
            out[arch, method] = kl_against(hf, ref)[0]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_outputs_load_everywhere_and_stay_close(kls, arch: str) -> None:
    got = {m: kls[arch, m] for m in ("rtn", "gptq", "awq")}
    print(arch, {m: f"{v:.5f}" for m, v in got.items()})
    assert got["rtn"] < 2 * RTN_KL[arch], got
    assert got["gptq"] < RTN_KL[arch] and got["awq"] < RTN_KL[arch], got
    assert got["awq"] <= AWQ_NOISE * got["rtn"], got

@pytest.mark.parametrize("arch", ARCHS)
def test_nf4_runs_on_every_architecture(arch_dirs, eval_ids, tmp_path: Path, arch: str) -> None:
    """bitsandbytes NF4 quantizes the whole model at load time (transformers' own replacement of nn.Linear)."""
    out = tmp_path / "nf4"
    assert main(["quantize", str(arch_dirs[arch]), "-o", str(out), "--method", "nf4", "--bits", "4"]) == 0
    model = compress.load(out)
    assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
    fp = AutoModelForCausalLM.from_pretrained(arch_dirs[arch], dtype=torch.float32).eval()
    lp, lq = torch.log_softmax(logits(fp, eval_ids), -1), torch.log_softmax(logits(model, eval_ids), -1)
    assert float((lp.exp() * (lp - lq)).sum(-1).mean()) < 2 * RTN_KL[arch]


@pytest.mark.parametrize("arch", ["phi3", "gpt_neox"])
def test_quantized_fused_qkv_runs_on_the_packed_engine(arch, arch_dirs, eval_ids, tmp_path: Path) -> None:
    """A 4-bit Phi-3 keeps its fused qkv_proj / gate_up_proj and a 4-bit GPT-NeoX its head-interleaved
    query_key_value (quantized as one Linear each); serve's packed engine calls them as they are (GPT-NeoX's
    output columns reordered) and gives the logits of the loaded model's own forward."""
    from memfit.runtime.generic import make_runner
    from memfit.runtime.slot_model import Segment, SlotModel

    _quantize(arch_dirs[arch], tmp_path / "q", "rtn", None)
    ids = eval_ids[0, :24]
    want = logits(compress.load(tmp_path / "q"), ids[None])[0]
    model = compress.load(tmp_path / "q")
    sm = make_runner(model, 2, 64)
    assert isinstance(sm, SlotModel) and hasattr(sm.layers[0].self_attn, "qkv_proj")
    assert sm.int4_kernel > 0 or sm.ops is None  # the quantized projections on memfit's int4 kernel
    first = sm.forward(ids[:17], [Segment(0, 0, 17)])[0]
    last = sm.forward(ids[17:], [Segment(0, 17, 7)])[0]
    for got, ref in ((first, want[16]), (last, want[23])):
        assert (got - ref).abs().max() < 2e-2 * ref.abs().max() and got.argmax() == ref.argmax()


def test_awq_record_names_the_folds_per_architecture(arch_dirs, calib_file: Path, tmp_path: Path) -> None:
    folded = {}
    for arch in ("gemma3_text", "phi3", "gpt_neox"):
        _quantize(arch_dirs[arch], tmp_path / arch, "awq", calib_file)
        folded[arch] = json.loads((tmp_path / arch / "config.json").read_text())["quantization_config"]["memfit"]
    assert folded["gemma3_text"]["awq"] == {"folded": [
        "input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj", "mlp.up_proj -> mlp.down_proj",
        "pre_feedforward_layernorm -> mlp.gate_proj, mlp.up_proj", "self_attn.v_proj -> self_attn.o_proj"]}
    assert folded["phi3"]["awq"] == {"folded": [
        "input_layernorm -> self_attn.qkv_proj", "mlp.gate_up_proj -> mlp.down_proj",
        "post_attention_layernorm -> mlp.gate_up_proj", "self_attn.qkv_proj -> self_attn.o_proj"]}
    neox = folded["gpt_neox"]["awq"]
    assert neox["folded"] == ["attention.query_key_value -> attention.dense",
                              "input_layernorm -> attention.query_key_value",
                              "post_attention_layernorm -> mlp.dense_h_to_4h"]
    assert len(neox["not_scaled"]) == 1 and neox["not_scaled"][0].startswith("mlp.dense_4h_to_h: not scaled")


def _layer_jobs(model, ids: torch.Tensor) -> list[LayerJob]:
    """A LayerJob per decoder layer of an HF model, with the inputs each layer really gets for ids."""
    layers = model.model.layers
    seen: list[list] = [[] for _ in layers]
    hooks = [ly.register_forward_pre_hook(lambda _m, a, kw, i=i: seen[i].append((a, dict(kw))), with_kwargs=True)
             for i, ly in enumerate(layers)]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    jobs = []
    for i, ly in enumerate(layers):
        lin = {n: m for n, m in ly.named_modules() if isinstance(m, torch.nn.Linear)}
        jobs.append(LayerJob(ly, f"model.layers.{i}.", lin, {n: QuantArgs(4, 32, False) for n in lin},
                             model.config, seen[i]))
    return jobs


def test_gemma3_awq_fold_keeps_the_float_logits(arch_dirs, eval_ids) -> None:
    """AWQ's searched scales folded into the Gemma 3 model (no rounding) compute the original logits: the MLP's
    scale goes into pre_feedforward_layernorm as w' = (1 + w) / s - 1, never into post_attention_layernorm."""
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["gemma3_text"], dtype=torch.float32).eval()
    before = logits(model, eval_ids)
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "layernorm" in n}
    for job in _layer_jobs(model, eval_ids):
        folds, _ = awq.scale_layer(job)
        kinds = {f.prev: f.kind for f in folds if f.kind}
        assert kinds == {"input_layernorm": "norm1p", "self_attn.v_proj": "linear",
                         "pre_feedforward_layernorm": "norm1p", "mlp.up_proj": "linear"}, kinds
    after = logits(model, eval_ids)
    changed = [n for n, p in model.named_parameters() if n in norms and not torch.equal(p, norms[n])]
    assert any("pre_feedforward_layernorm" in n for n in changed) and not any("post_" in n for n in changed)
    assert torch.allclose(after, before, atol=1e-4 * float(before.abs().max()), rtol=0)


def test_wrong_gemma_folds_are_caught(arch_dirs, eval_ids) -> None:
    """The check every fold passes rejects the two Llama-style mistakes on Gemma 3: the MLP scale folded into
    post_attention_layernorm, and w / s instead of (1 + w) / s - 1."""
    model = AutoModelForCausalLM.from_pretrained(arch_dirs["gemma3_text"], dtype=torch.float32).eval()
    job = _layer_jobs(model, eval_ids)[0]
    ref = awqfold._first_output(job)
    delta = float((ref - job.inputs[0][0][0]).abs().max())
    mlp = ["mlp.gate_proj", "mlp.up_proj"]
    assert awqfold._exact(job, awqfold.Fold(mlp, "norm1p", "pre_feedforward_layernorm", n_scale=128), ref, delta)
    assert not awqfold._exact(job, awqfold.Fold(mlp, "norm1p", "post_attention_layernorm", n_scale=128), ref, delta)
    assert not awqfold._exact(job, awqfold.Fold(mlp, "norm", "pre_feedforward_layernorm", n_scale=128), ref, delta)


def test_gemma3_prune_and_lowrank_load_and_run(arch_dirs, eval_ids, calib_file: Path, tmp_path: Path) -> None:
    """wanda 2:4 and svd on gemma3_text: compress.load runs them; the pruned model holds the original weights
    (fp16) on a 2:4 mask; each factorized Linear is two Linears whose product is W's best rank-k approximation
    (random weights have a flat spectrum, so the logits themselves move a lot at any ratio)."""
    src = arch_dirs["gemma3_text"]
    fp = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    want = logits(fp, eval_ids)
    assert main(["prune", str(src), "-o", str(tmp_path / "p"), "--method", "wanda", "--pattern", "2:4",
                 "--calib", str(calib_file), *CAL]) == 0
    assert main(["lowrank", str(src), "-o", str(tmp_path / "l"), "--method", "svd", "--ratio", "0.8"]) == 0
    pruned, factored = compress.load(tmp_path / "p"), compress.load(tmp_path / "l")
    for model in (pruned, factored):
        got = logits(model, eval_ids)
        assert got.shape == want.shape and torch.isfinite(got).all()
    for name, m in fp.model.layers.named_modules():
        if isinstance(m, torch.nn.Linear):
            wp = pruned.model.layers.get_submodule(name).weight
            kept = wp != 0
            assert int(kept.view(wp.shape[0], -1, 4).sum(-1).max()) <= 2, name
            assert torch.equal(wp[kept], m.weight.half().float()[kept]), name
            two = factored.model.layers.get_submodule(name)
            assert isinstance(two, torch.nn.Sequential), name
            w = m.weight.detach().double()
            sv = torch.linalg.svdvals(w)
            best = float(sv[two[0].out_features:].pow(2).sum().sqrt())
            prod = two[1].weight.detach().double() @ two[0].weight.detach().double()
            assert abs(float(torch.linalg.matrix_norm(w - prod)) - best) < 1e-2 * float(sv.pow(2).sum().sqrt()), name


def test_calibration_keeps_each_layers_own_mask(arch_dirs, eval_ids) -> None:
    """Gemma 3's sliding layer (window 8) and full layer get different masks and rotary tables; the walk
    captures each layer's own instead of reusing layer 0's."""
    from compress.walk import capture_layers

    model = AutoModelForCausalLM.from_pretrained(arch_dirs["gemma3_text"], dtype=torch.float32).eval()
    per_layer = capture_layers(model, model.model.layers, eval_ids, 2)

    def same(a, b) -> bool:  # tensors, None (sdpa's causal fast path) or tuples of them
        if isinstance(a, tuple):
            return isinstance(b, tuple) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a is b is None or (a is not None and b is not None and torch.equal(a, b))

    for i, job in enumerate(_layer_jobs(model, eval_ids[:2])):
        got, want = per_layer[i][0][1], job.inputs[0][1]
        assert same(got["attention_mask"], want["attention_mask"]), i
        assert same(got["position_embeddings"], want["position_embeddings"]), i
    assert per_layer[0][0][0][0] is not None and per_layer[1][0][0][0] is None
    k0, k1 = per_layer[0][0][1], per_layer[1][0][1]
    assert not same(k0["attention_mask"], k1["attention_mask"])
    assert not same(k0["position_embeddings"], k1["position_embeddings"])

def test_gpt2_conv1d_layers_compress_as_linears(tmp_path: Path, eval_ids, calib_file: Path, capsys) -> None:
    """gpt2's Conv1D (weight stored [in, out]) is compressed as the Linear it is: every method's output loads
    with compress.load (its Conv1Ds become Linears), the 4-bit one runs on serve's packed engine (on the C++
    layer loop too), and compress
    says that transformers' own loader cannot read these outputs."""
    from memfit.runtime.generic import make_runner
    from memfit.runtime.slot_model import Segment, SlotModel

    src = make_arch_dir(tmp_path / "gpt2", "gpt2")
    fp = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ref = kl_reference(fp, eval_ids.flatten(), 48)
    kl = {}
    for method in ("rtn", "gptq", "awq"):
        _quantize(src, tmp_path / method, method, calib_file)
        assert "Conv1D layers are stored as Linear weights" in capsys.readouterr().err
        kl[method] = kl_against(load(tmp_path / method, backend="dequant"), ref)[0]
    print("gpt2", {m: f"{v:.5f}" for m, v in kl.items()})
    assert kl["rtn"] < 2 * RTN_KL["gpt2"] and kl["gptq"] < RTN_KL["gpt2"], kl
    assert kl["awq"] < AWQ_NOISE * kl["rtn"], kl
    assert main(["prune", str(src), "-o", str(tmp_path / "p"), "--method", "wanda", "--pattern", "2:4",
                 "--calib", str(calib_file), *CAL]) == 0
    assert main(["lowrank", str(src), "-o", str(tmp_path / "l"), "--method", "svd", "--ratio", "0.8"]) == 0
    for d in ("p", "l"):
        model = compress.load(tmp_path / d)
        assert kl_against(model, ref)[0] < 1.0, d  # random weights: pruning / low rank move the logits a lot
    ids = eval_ids[0, :40]
    want = logits(compress.load(tmp_path / "rtn"), ids[None])[0]
    for kernels in ("off", "on"):  # on: the C++ layer loop over the int4 kernels (LayerNorms, GELU MLP in C++)
        sm = make_runner(compress.load(tmp_path / "rtn"), 2, 64, dense_kernel=kernels, cpu_kernels=kernels)
        assert isinstance(sm, SlotModel) and (sm.stack is not None) == (kernels == "on")
        first = sm.forward(ids[:33], [Segment(0, 0, 33)])[0]
        last = sm.forward(ids[33:], [Segment(0, 33, 7)])[0]
        for got, w in ((first, want[32]), (last, want[39])):
            assert (got - w).abs().max() < 2e-2 * w.abs().max() and got.argmax() == w.argmax(), kernels
