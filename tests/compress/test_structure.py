"""compress's structure: one method registry, one layer walk, typed recipes, no import cycles."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from compress import calib, methods, walk
from compress.cli import main
from compress.recipe import LowrankStep, PruneStep, QuantizeStep, load_recipe
from memfit.defaults import CALIB_SAMPLES, CALIB_SEQLEN, GROUP_SIZE

PKG = Path(__file__).resolve().parents[2] / "compress"
CAL = ["--calib-samples", "4", "--calib-seqlen", "32"]


def _imports(path: Path) -> set[str]:
    """compress modules a file imports, at module level or inside functions."""
    mods = {p.stem for p in PKG.glob("*.py")}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("compress")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "compress":
            if node.module == "compress":
                found |= {f"compress.{a.name}" if a.name in mods else "compress" for a in node.names}
            else:
                found.add(node.module)
    return found


def test_no_import_cycle_in_compress() -> None:
    graph = {f"compress.{p.stem}" if p.stem != "__init__" else "compress": _imports(p) for p in PKG.glob("*.py")}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*path, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    # the CLI is a leaf: nothing in compress imports it
    assert not [m for m, deps in graph.items() if "compress.cli" in deps and m != "compress.__main__"]


def test_one_walk_in_the_source() -> None:
    """Only walk.py materializes decoder layers, captures calibration inputs and writes outputs' weights."""
    walk_only = {"materialize", "capture_inputs", "decoder_layers", "save_file", "calibration_tokens", "tqdm"}
    for p in PKG.glob("*.py"):
        if p.name in ("walk.py", "skeleton.py", "calib.py"):  # skeleton / calib define some of them
            continue
        if p.name in ("budget.py", "sensitivity.py"):  # a size budget reads the layer list of a meta model and
            # measures on the whole fp32 model (no layer walk, nothing written but its JSON)
            continue
        names = {n.id for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Name)}
        names |= {a.name for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ImportFrom)
                  for a in n.names}
        assert not names & walk_only, f"{p.name} uses {sorted(names & walk_only)}: only walk.py may"


def test_registry_is_the_one_word_on_calibration() -> None:
    calibrated = {n for n, m in methods.METHODS.items() if m.calibrated}
    assert calibrated == {"gptq", "awq", "sparse-gptq", "wanda", "sparsegpt", "svd-llm", "asvd"}
    for p in PKG.glob("*.py"):  # no second list of calibrated methods anywhere
        text = p.read_text()
        assert "NEEDS_CALIBRATION" not in text and "CALIBRATED" not in text, p.name
    assert methods.METHODS["rtn"].calibration(["/nope"]) is None  # not even looked at
    assert methods.names("quantize", layerwise=True) == ("rtn", "gptq", "awq")
    assert methods.METHODS[methods.METHODS["gptq"].after_prune].layer is not None


def test_defaults_come_from_memfit_defaults() -> None:
    """No literal 128/512 as a flag default, keyword or parameter default for a size: each is a named constant."""
    sizes = {"calib_samples", "calib_seqlen", "samples", "seqlen", "group_size", "default"}
    for p in PKG.glob("*.py"):
        for n in ast.walk(ast.parse(p.read_text())):
            pairs = []
            if isinstance(n, ast.keyword):
                pairs = [(n.arg, n.value)]
            elif isinstance(n, ast.arguments):
                pos = n.posonlyargs + n.args
                pairs = [(a.arg, d) for a, d in zip(pos[len(pos) - len(n.defaults):], n.defaults, strict=True)]
                pairs += [(a.arg, d) for a, d in zip(n.kwonlyargs, n.kw_defaults, strict=True) if d is not None]
            for arg, value in pairs:
                assert not (arg in sizes and isinstance(value, ast.Constant) and value.value in (128, 512)), \
                    f"{p.name}: literal default {arg}={value.value}"
    r = PruneStep(), QuantizeStep()
    assert r[1].group_size == GROUP_SIZE
    c = methods.METHODS["gptq"]
    assert c.calibration.__defaults__ == (CALIB_SAMPLES, CALIB_SEQLEN, 0)


@pytest.mark.parametrize("cmd", [["quantize", "--method", "rtn"], ["prune", "--method", "magnitude"],
                                 ["lowrank", "--method", "svd"]])
def test_uncalibrated_methods_load_no_text_and_no_tokenizer(tiny: Path, tmp_path: Path, monkeypatch, capsys,
                                                            cmd: list[str]) -> None:
    """The registry's flag drives what the CLI loads: without it, no calibration files and no tokenizer;
    flipping the flag in the registry makes the same command demand calibration text."""
    monkeypatch.setattr(calib, "SHAKESPEARE", tmp_path / "no-corpus")

    def no_tokenizer(*a, **k):
        raise AssertionError("tokenizer loaded for an uncalibrated method")

    monkeypatch.setattr(walk, "load_tokenizer", no_tokenizer)
    assert main([cmd[0], str(tiny), "-o", str(tmp_path / "a"), *cmd[1:], "--calib", str(tmp_path / "nope")]) == 0
    name = cmd[2]
    monkeypatch.setitem(methods.METHODS, name, replace(methods.METHODS[name], calibrated=True))
    assert main([cmd[0], str(tiny), "-o", str(tmp_path / "b"), *cmd[1:]]) == 2
    assert f"method {name} needs calibration text" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_calibrated_method_loads_the_tokenizer_once(tiny: Path, tmp_path: Path, calib_file: Path,
                                                    monkeypatch) -> None:
    calls = []
    real = walk.load_tokenizer
    monkeypatch.setattr(walk, "load_tokenizer", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert main(["prune", str(tiny), "-o", str(tmp_path / "w"), "--method", "wanda", "--calib", str(calib_file),
                 *CAL]) == 0
    assert len(calls) == 1


def _spy_walk(monkeypatch) -> dict[str, int]:
    """Count each method's layer calls, failing any made outside LayerWalk.run."""
    calls: dict[str, int] = {}
    inside = {"run": False}
    real_run = walk.LayerWalk.run

    def run(self, method, *a, **k):
        inside["run"] = True
        try:
            return real_run(self, method, *a, **k)
        finally:
            inside["run"] = False

    monkeypatch.setattr(walk.LayerWalk, "run", run)
    for name, m in list(methods.METHODS.items()):
        if m.layer is None:
            continue

        def layer(job, name=name, fn=m.layer):
            assert inside["run"], f"{name} ran outside the layer walk"
            calls[name] = calls.get(name, 0) + 1
            return fn(job)

        monkeypatch.setitem(methods.METHODS, name, replace(m, layer=layer))
    return calls


@pytest.mark.parametrize("kind,name", [(m.kind, m.name) for m in methods.METHODS.values()
                                       if m.layer is not None and m.listed])
def test_every_method_runs_through_the_one_walk(tiny: Path, tmp_path: Path, calib_file: Path, monkeypatch,
                                                kind: str, name: str) -> None:
    calls = _spy_walk(monkeypatch)
    extra = {"quantize": ["--bits", "4"], "prune": ["--pattern", "2:4"], "lowrank": ["--ratio", "0.5"]}[kind]
    out = tmp_path / "o"
    assert main([kind, str(tiny), "-o", str(out), "--method", name, "--calib", str(calib_file), *CAL, *extra]) == 0
    assert calls == {name: 2}  # once per decoder layer of the tiny model, and no other method
    assert (out / "model.safetensors").is_file()


def test_pipeline_steps_run_through_the_one_walk(tiny: Path, tmp_path: Path, calib_file: Path, monkeypatch) -> None:
    calls = _spy_walk(monkeypatch)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"calib: [{calib_file}]\ncalib_samples: 4\ncalib_seqlen: 32\nsteps:\n"
                      "  - prune: {method: magnitude, sparsity: 0.3}\n  - prune: {method: wanda, pattern: '2:4'}\n"
                      "  - quantize: {bits: 4, method: gptq, group_size: 64}\n")
    assert main(["pipeline", "--config", str(recipe), "--model", str(tiny), "-o", str(tmp_path / "o")]) == 0
    assert calls == {"magnitude": 2, "wanda": 2, "sparse-gptq": 2}  # gptq after a prune: its after_prune variant


def test_recipe_is_typed(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\nsteps:\n  - prune: {pattern: '2:4', skip: 'lm_head, mlp.down_proj'}\n"
                      "  - quantize: {bits: 8}\n")
    r = load_recipe(str(recipe))
    assert r.model == "m" and r.output is None and (r.calib_samples, r.calib_seqlen) == (CALIB_SAMPLES, CALIB_SEQLEN)
    prune, quant = r.steps
    assert isinstance(prune, PruneStep) and prune.method == methods.DEFAULT["prune"]
    assert prune.skip == ["lm_head", "mlp.down_proj"] and prune.sparsity is None
    assert isinstance(quant, QuantizeStep) and quant.method == "rtn" and quant.group_size == GROUP_SIZE
    assert quant.given == {"bits": 8}  # what memfit_steps records
    for cls in (PruneStep, LowrankStep, QuantizeStep):  # every field documented (a string right after it)
        src = ast.parse(Path(__file__).resolve().parents[2].joinpath("compress/recipe.py").read_text())
        body = next(n for n in src.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__).body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and "ClassVar" not in ast.unparse(stmt.annotation):
                nxt = body[i + 1]
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                    f"{cls.__name__}.{stmt.target.id} has no docstring"


@pytest.mark.parametrize("text,msg", [
    ("steps:\n  - prune: {sparsity: half}\n", "step 1 (prune): sparsity must be a number or null, got 'half'"),
    ("steps:\n  - prune: {pattern: 2:4}\n", "step 1 (prune): pattern must be a string, got 124"),
    ("steps:\n  - prune: {sparsity: 0.7, pattern: '2:4'}\n", "step 1 (prune): pattern 2:4 means sparsity 0.5; "
     "got sparsity 0.7"),
    ("steps:\n  - prune: {method: svd}\n", "step 1 (prune): method: 'svd' is not a prune method"),
    ("steps:\n  - prune: {}\n  - lowrank: {ratio: 1.5}\n", "step 2 (lowrank): ratio must be in (0, 1]"),
    ("steps:\n  - quantize: {bits: 5}\n", "step 1 (quantize): bits must be one of 2, 3, 4, 8, got 5"),
    ("steps:\n  - quantize: {method: nf4}\n", "step 1 (quantize): method 'nf4' is not supported here"),
    ("steps:\n  - quantize: {group_size: 0}\n", "step 1 (quantize): group_size must be positive"),
    ("steps:\n  - quantize: {sym: 1}\n", "step 1 (quantize): sym must be true or false, got 1"),
    ("steps:\n  - quantize: 4\n", "step 1 (quantize): options must be a mapping"),
    ("calib_samples: 0\nsteps:\n  - prune: {}\n", "calib_samples must be > 0"),
    ("calib_seqlen: long\nsteps:\n  - prune: {}\n", "calib_seqlen must be an integer, got 'long'"),
    ("calib: x.txt\nsteps:\n  - prune: {}\n", "calib must be a list of strings or null"),
    ("colour: red\nsteps:\n  - prune: {}\n", "unknown options ['colour']"),
    ("steps: []\n", "needs a non-empty `steps:` list"),
])
def test_recipe_errors_name_the_key(tiny: Path, tmp_path: Path, capsys, text: str, msg: str) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    code = main(["pipeline", "--config", str(recipe), "--model", str(tiny), "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and msg in err, err
    assert not (tmp_path / "out").exists()
