"""compress prune / lowrank / pipeline: exact sparsity and patterns, storage, save/load, rank arithmetic,
whitening, recipes, and bad input (message + exit code 2, no output written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import compress
from compress import calib, lowrank
from compress.calib import Calibration
from compress.cli import main
from compress.gptq import Hessian
from compress.loader import load
from compress.prune import lowrank_model, prune_model
from compress.store import WeightSource
from memfit.runtime.linear import weight_format

from .conftest import logits

IDS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def copts(calib_file: Path) -> Calibration:
    return Calibration((calib_file,), samples=8, seqlen=64)


def weights(model) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": layer.get_submodule(n).weight.detach() for i, layer in enumerate(model.model.layers)
            for n in LINEARS}


@pytest.fixture(scope="module")
def pruned(tiny: Path, calib_file: Path, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("pruned")
    out = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        for pattern in ("unstructured", "2:4", "4:8"):
            d = root / f"{method}-{pattern.replace(':', 'of')}"
            prune_model(str(tiny), d, method, None, pattern, copts(calib_file), ["lm_head"], progress=False)
            out[method, pattern] = d
    return out


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
@pytest.mark.parametrize("pattern", ["unstructured", "2:4", "4:8"])
def test_exact_sparsity_and_pattern(pruned, method: str, pattern: str) -> None:
    d = pruned[method, pattern]
    model = compress.load(d)
    for name, w in weights(model).items():
        assert int((w == 0).sum()) == w.numel() // 2, name  # exactly 50% of every pruned Linear
        if pattern != "unstructured":
            n, m = map(int, pattern.split(":"))
            kept = (w != 0).view(w.shape[0], -1, m).sum(-1)
            assert bool((kept == n).all()), name
        elif method == "wanda":  # compared per output row
            assert bool(((w == 0).sum(1) == w.shape[1] // 2).all()), name
    assert model.lm_head.weight.count_nonzero() == model.lm_head.weight.numel()  # lm_head/embedding untouched
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["sparsity_config"]["format"] == "sparse-bitmask"
    assert qc["sparsity_config"]["sparsity_structure"] == pattern and qc["memfit"]["method"] == method
    assert abs(qc["sparsity_config"]["global_sparsity"] - 0.5) < 1e-9


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_wanda_metric_per_row_from_one_pass_of_the_unpruned_layer(tiny: Path, nm) -> None:
    """Wanda's mask is exactly: score |W_ij| * ||X_j||_2 over every calibration token, the lowest half removed
    per output row (unstructured) or the 2 lowest of each group of 4 consecutive inputs of a row (2:4), with X
    the Linear's input in the layer before any of its Linears is pruned (as the authors' code does)."""
    from compress import wanda
    from compress.layerjob import LayerJob
    from compress.walk import capture_inputs

    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    layer = model.model.layers[0]
    inputs = capture_inputs(model, model.model.layers, IDS, 2)
    lin = {n: layer.get_submodule(n) for n in LINEARS}
    orig = {n: m.weight.detach().clone() for n, m in lin.items()}
    job = LayerJob(layer, "model.layers.0.", lin, {}, model.config, inputs, {"sparsity": 0.5, "nm": nm})
    sq: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def f(_m, a):
            sq[name] = sq.get(name, 0) + a[0].reshape(-1, a[0].shape[-1]).double().pow(2).sum(0)
        return f

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in lin.items()]
    with torch.no_grad():
        for args, kwargs in inputs:
            layer(*args, **kwargs)
    for h in handles:
        h.remove()
    out = wanda.wanda_layer(job)
    for n in LINEARS:
        score = orig[n].abs() * sq[n].sqrt().float()
        rows, cols = score.shape
        g = score.view(rows, cols // 4, 4) if nm else score.view(rows, 1, cols)
        keep = g.shape[-1] // 2
        want = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.topk(keep, dim=-1).indices, True).view(rows, cols)
        assert torch.equal(out[n] != 0, want), n
        assert torch.equal(out[n][want], orig[n][want]), n  # no weight update


def test_calibrated_pruning_keeps_outputs_closer_than_magnitude(pruned, tiny: Path) -> None:
    ref = logits(AutoModelForCausalLM.from_pretrained(tiny), IDS)
    err = {m: float((logits(compress.load(pruned[m, "unstructured"]), IDS) - ref).pow(2).mean())
           for m in ("magnitude", "wanda", "sparsegpt")}
    assert err["sparsegpt"] < err["magnitude"] and err["wanda"] < err["magnitude"], err


def test_sparse_storage_save_load_and_size(tiny: Path, calib_file: Path, tmp_path: Path) -> None:
    sparse, dense = tmp_path / "sparse", tmp_path / "dense"
    prune_model(str(tiny), sparse, "wanda", 0.5, "unstructured", copts(calib_file), ["lm_head"], progress=False)
    prune_model(str(tiny), dense, "wanda", 0.5, "unstructured", copts(calib_file), ["lm_head"], dense=True,
                progress=False)
    got = logits(compress.load(sparse), IDS)
    want = logits(AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32), IDS)  # plain HF, zeros dense
    assert torch.equal(got, want)
    src = WeightSource(sparse)
    assert "model.layers.0.mlp.up_proj.weight.bitmask" in src and "model.layers.0.mlp.up_proj.weight" not in src
    pruned_bytes = sum(src.get(k).numel() * src.get(k).element_size() for k in src.keys() if ".weight." in k)
    dense_src = WeightSource(dense)
    dense_bytes = sum(dense_src.get(f"model.layers.{i}.{n}.weight").numel() * 2 for i in range(2) for n in LINEARS)
    assert pruned_bytes <= 0.6 * dense_bytes  # values + 1 bit per weight (0.5625x) + an int64 offset per row
    assert src.file_bytes() < 0.7 * dense_src.file_bytes()  # whole file, the tied embedding stays dense


def test_rank_arithmetic(tiny: Path, tmp_path: Path) -> None:
    assert lowrank.rank_for(256, 704, 0.8) == 150 and lowrank.rank_for(256, 256, 0.8) == 102
    assert lowrank.rank_for(128, 320, 0.5) == 45  # floor(128*320*0.5/448) = floor(45.7)
    out = tmp_path / "lr"
    s = lowrank_model(str(tiny), out, "svd", 0.5, None, ["lm_head"], progress=False)
    src = WeightSource(out)
    kept = orig = 0
    for i in range(2):
        for n in LINEARS:
            name = f"model.layers.{i}.{n}"
            wv, wu = src.get(f"{name}.0.weight"), src.get(f"{name}.1.weight")
            m, k = wu.shape[0], wv.shape[1]
            r = wv.shape[0]
            assert r == wu.shape[1] == m * k * 0.5 // (m + k) == s["ranks"][name]
            assert r * (m + k) <= 0.5 * m * k < (r + 1) * (m + k)
            kept, orig = kept + r * (m + k), orig + m * k
    assert abs(s["kept"] - kept / orig) < 1e-12
    model = compress.load(out)
    mod = model.model.layers[0].mlp.down_proj
    assert isinstance(mod, torch.nn.Sequential) and [type(x) for x in mod] == [torch.nn.Linear] * 2
    ref = AutoModelForCausalLM.from_pretrained(tiny).eval()
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            for n in LINEARS:
                name = f"model.layers.{i}.{n}"
                layer.get_submodule(n).weight.copy_(src.get(f"{name}.1.weight").float() @
                                                    src.get(f"{name}.0.weight").float())
        for k in ("model.embed_tokens.weight", "model.norm.weight"):
            ref.get_parameter(k).copy_(src.get(k).float())
        for i in range(2):
            for k in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                ref.model.layers[i].get_parameter(k).copy_(src.get(f"model.layers.{i}.{k}").float())
    got, want = logits(model, IDS), logits(ref, IDS)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_whitening_beats_plain_svd_on_a_toy_layer() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    scales = torch.logspace(-1, 1, 64)  # anisotropic, correlated inputs, like real activations
    x = (torch.randn(2000, 64, generator=g) * scales) @ torch.linalg.qr(torch.randn(64, 64, generator=g))[0]
    h = Hessian(64)
    h.add(x)
    k = 8
    err = {}
    for name, (wu, wv) in {"svd": lowrank.svd(w, k), "svd-llm": lowrank.svd_llm(w, h.H, k),
                           "asvd": lowrank.asvd(w, x.abs().mean(0), k)}.items():
        assert wu.shape == (48, k) and wv.shape == (k, 64)
        err[name] = float(torch.linalg.norm(x.double() @ (w - wu @ wv).t().double()))
    assert err["svd-llm"] < err["svd"] and err["svd-llm"] < err["asvd"]
    # SVD-LLM is the optimal rank-k fit of the outputs: its error is the truncated singular values of W S
    S = torch.linalg.cholesky(x.double().t() @ x.double())
    sig = torch.linalg.svdvals(w.double() @ S)
    assert abs(err["svd-llm"] - float(sig[k:].pow(2).sum().sqrt())) < 1e-3 * err["svd-llm"]
    wu, wv = lowrank.svd(w, k)  # plain SVD is the best fit of W itself
    assert abs(float(torch.linalg.norm(w - wu @ wv)) - float(torch.linalg.svdvals(w)[k:].pow(2).sum().sqrt())) < 1e-3


def test_pipeline_prune24_then_quant4_loads(tiny: Path, calib_file: Path, tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny}\noutput: {tmp_path / 'out'}\ncalib: [{calib_file}]\ncalib_samples: 8\n"
                      "calib_seqlen: 64\nsteps:\n  - prune: {method: sparsegpt, pattern: '2:4'}\n"
                      "  - quantize: {bits: 4, method: gptq, group_size: 64}\n")
    assert main(["pipeline", "--config", str(recipe)]) == 0
    out = tmp_path / "out"
    assert not list(tmp_path.glob(".out*"))  # work dir and temp dir cleaned up
    cfg = json.loads((out / "config.json").read_text())
    assert [next(iter(s)) for s in cfg["memfit_steps"]] == ["prune", "quantize"]
    assert cfg["quantization_config"]["memfit"]["method"] == "sparse-gptq"
    model = compress.load(out)  # int4 CPU kernel (bf16 zero offsets: the zeros are only approximately 0 there)
    assert weight_format(model.model.layers[0].mlp.up_proj) in ("int4_cpu", "dequant")
    assert torch.isfinite(logits(model, IDS)).all()
    exact = load(out, backend="dequant")  # the stored codes, dequantized in fp32
    for i, layer in enumerate(exact.model.layers):
        for n in LINEARS:
            q = layer.get_submodule(n)
            assert weight_format(q) in ("int4_cpu", "dequant") and q.bits == 4
            w = q.dequantized_weight()
            kept = (w != 0).view(w.shape[0], -1, 4).sum(-1)
            assert int(kept.max()) <= 2, f"{i}.{n}: 2:4 pattern lost in quantization"
    code = main(["pipeline", "--config", str(recipe)])
    assert code == 2 and "already exists" in capsys.readouterr().err


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args,msg", [
    (["--sparsity", "0"], "--sparsity must be in (0, 1)"),
    (["--sparsity", "1"], "--sparsity must be in (0, 1)"),
    (["--sparsity", "1.5"], "--sparsity must be in (0, 1)"),
    (["--pattern", "3:7"], "M=7 does not divide in_features 128 of model.layers.0.self_attn.q_proj"),
    (["--pattern", "2:4", "--sparsity", "0.7"], "--pattern 2:4 means sparsity 0.5"),
    (["--pattern", "dense"], "--pattern must be 'unstructured' or N:M"),
    (["--pattern", "4:4"], "need 0 < N < M"),
])
def test_prune_bad_numbers(tiny: Path, tmp_path: Path, capsys, args: list[str], msg: str) -> None:
    code, err = run(capsys, "prune", str(tiny), "-o", str(tmp_path / "p"), "--method", "magnitude", *args)
    assert code == 2 and msg in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written, no temp dir left


@pytest.mark.parametrize("ratio,msg", [("0.001", "gives rank 0 < 1 for model.layers.0.self_attn.q_proj"),
                                       ("0", "--ratio must be in (0, 1]"), ("1.5", "--ratio must be in (0, 1]")])
def test_lowrank_bad_ratio(tiny: Path, tmp_path: Path, capsys, ratio: str, msg: str) -> None:
    code, err = run(capsys, "lowrank", str(tiny), "-o", str(tmp_path / "l"), "--method", "svd", "--ratio", ratio)
    assert code == 2 and msg in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("cmd", [["prune", "--method", "wanda"], ["lowrank", "--method", "svd-llm"]])
def test_missing_calibration(tiny: Path, tmp_path: Path, capsys, monkeypatch, cmd: list[str]) -> None:
    out = str(tmp_path / "o")
    code, err = run(capsys, cmd[0], str(tiny), "-o", out, *cmd[1:], "--calib", str(tmp_path / "nope.txt"))
    assert code == 2 and "nope.txt does not exist" in err
    monkeypatch.setattr(calib, "SHAKESPEARE", tmp_path / "no-corpus")
    code, err = run(capsys, cmd[0], str(tiny), "-o", out, *cmd[1:])
    assert code == 2 and f"method {cmd[2]} needs calibration text" in err
    assert not Path(out).exists()


def test_output_rules(tiny: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    for cmd in (["prune", "--method", "magnitude"], ["lowrank", "--method", "svd"]):
        code, err = run(capsys, cmd[0], str(tiny), "-o", str(out), *cmd[1:])
        assert code == 2 and "already exists (pass --overwrite" in err
        assert (out / "keep.txt").is_file()
    code, err = run(capsys, "prune", str(tiny), "-o", str(tiny), "--method", "magnitude")
    assert code == 2 and "--output must differ from MODEL" in err
    assert run(capsys, "lowrank", str(tiny), "-o", str(out), "--method", "svd", "--overwrite")[0] == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # renamed into place, no temp dir left
    code, err = run(capsys, "prune", str(out), "-o", str(tmp_path / "again"), "--method", "magnitude")
    assert code == 2 and "already compressed" in err and "start from a dense model" in err


@pytest.mark.parametrize("steps,msg", [
    ("  - quantize: {bits: 4}\n  - prune: {}\n", "step 1 (quantize) must be the last step"),
    ("  - distill: {}\n", "step 1 must be one of"),
    ("  - prune: {sparsity: 0.5, colour: red}\n", "unknown options ['colour']"),
])
def test_pipeline_bad_recipe(tiny: Path, tmp_path: Path, capsys, steps: str, msg: str) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny}\noutput: {tmp_path / 'out'}\nsteps:\n{steps}")
    code, err = run(capsys, "pipeline", "--config", str(recipe))
    assert code == 2 and msg in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("steps,kind", [
    ("  - prune: {method: magnitude, sparsity: 0.5}\n", "Linear"),
    ("  - prune: {method: magnitude, pattern: '4:8'}\n  - lowrank: {method: svd, ratio: 0.5}\n", "Sequential"),
])
def test_pipeline_other_recipes_load(tiny: Path, tmp_path: Path, steps: str, kind: str) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"steps:\n{steps}")
    out = tmp_path / "out"
    assert main(["pipeline", "--config", str(recipe), "--model", str(tiny), "-o", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert len(cfg["memfit_steps"]) == steps.count("- ")
    model = compress.load(out)
    assert type(model.model.layers[1].mlp.down_proj).__name__ == kind
    assert torch.isfinite(logits(model, IDS)).all()
    if kind == "Linear":  # a prune-only recipe is stored sparse, like `compress prune`
        assert "model.layers.0.mlp.up_proj.weight.bitmask" in WeightSource(out)
