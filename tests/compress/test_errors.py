"""Every bad input: a clear message on stderr naming the problem, exit code 2, no half-written output."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import compress
from compress import calib, methods
from compress.cli import main
from memfit.errors import UserError


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_unsupported_bits(tiny: Path, tmp_path: Path, capsys) -> None:
    code, err = run(capsys, "quantize", str(tiny), "-o", str(tmp_path / "q"), "--bits", "5")
    assert code == 2 and "--bits" in err and "invalid choice: 5" in err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("method,bits", [("nf4", 3), ("int8", 4)])
def test_bnb_method_width_mismatch(tiny: Path, tmp_path: Path, capsys, method: str, bits: int) -> None:
    code, err = run(capsys, "quantize", str(tiny), "-o", str(tmp_path / "q"), "--method", method, "--bits", str(bits))
    assert code == 2 and f"--method {method}" in err


def test_group_size_not_dividing_in_features_refused_without_fallback(tiny: Path, tmp_path: Path, capsys) -> None:
    code, err = run(capsys, "quantize", str(tiny), "-o", str(tmp_path / "q"), "--method", "rtn",
                    "--no-group-fallback")
    assert code == 2
    assert "model.layers.0.mlp.down_proj: group size 128 does not divide in_features 320" in err
    code, err = run(capsys, "quantize", str(tiny), "-o", str(tmp_path / "q"), "--group-size", "0")
    assert code == 2 and "--group-size must be positive" in err
    assert not (tmp_path / "q").exists()


def test_calibration_required_but_missing(tiny: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    out = str(tmp_path / "q")
    code, err = run(capsys, "quantize", str(tiny), "-o", out, "--method", "gptq", "--calib", str(tmp_path / "nope.txt"))
    assert code == 2 and "nope.txt does not exist" in err
    monkeypatch.setattr(calib, "SHAKESPEARE", tmp_path / "no-corpus")
    code, err = run(capsys, "quantize", str(tiny), "-o", out, "--method", "awq")
    assert code == 2 and "method awq needs calibration text" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("hi")
    code, err = run(capsys, "quantize", str(tiny), "-o", out, "--method", "gptq", "--calib", str(empty))
    assert code == 2 and "tokens of calibration text" in err
    assert not Path(out).exists()


def _copy(tiny: Path, dest: Path) -> Path:
    shutil.copytree(tiny, dest)
    return dest


def test_missing_shard_named(tiny: Path, tmp_path: Path, capsys) -> None:
    d = _copy(tiny, tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = run(capsys, "quantize", str(d), "-o", str(tmp_path / "q"), "--method", "rtn")
    assert code == 2 and "model-00002-of-00002.safetensors" in err and "missing" in err
    with pytest.raises(UserError, match="model-00002-of-00002.safetensors"):
        compress.load(d)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_shard_named(tiny: Path, tmp_path: Path, capsys, damage: str) -> None:
    d = _copy(tiny, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 64 + data[64:])
    code, err = run(capsys, "quantize", str(d), "-o", str(tmp_path / "q"), "--method", "rtn")
    assert code == 2 and str(f) in err and "corrupt" in err
    code, err = run(capsys, "info", str(d))
    assert code == 2 and str(f) in err
    with pytest.raises(UserError, match="corrupt"):
        compress.load(d)


def test_corrupt_quantized_output_refused(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    assert main(["quantize", str(tiny), "-o", str(out), "--method", "rtn"]) == 0
    from safetensors.torch import load_file, save_file

    t = load_file(out / "model.safetensors")
    del t["model.layers.1.self_attn.o_proj.weight_packed"]
    save_file(t, out / "model.safetensors")
    with pytest.raises(UserError, match="model.layers.1.self_attn.o_proj.weight_packed is missing"):
        compress.load(out)


def test_output_exists_refused_unless_overwrite(tiny: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "q"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run(capsys, "quantize", str(tiny), "-o", str(out), "--method", "rtn")
    assert code == 2 and "already exists" in err and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"
    code, _ = run(capsys, "quantize", str(tiny), "-o", str(out), "--method", "rtn", "--overwrite")
    assert code == 0 and not (out / "keep.txt").exists() and (out / "config.json").is_file()
    code, err = run(capsys, "quantize", str(tiny), "-o", str(tiny), "--overwrite")
    assert code == 2 and "must differ" in err


def test_not_a_model_and_pickle_only(tmp_path: Path, capsys) -> None:
    code, err = run(capsys, "quantize", str(tmp_path / "none"), "-o", str(tmp_path / "q"))
    assert code == 2 and "is not a directory" in err
    d = tmp_path / "pkl"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04")
    code, err = run(capsys, "quantize", str(d), "-o", str(tmp_path / "q"))
    assert code == 2 and "pickle" in err
    with pytest.raises(UserError, match="pickle"):
        compress.load(d)


def test_already_quantized_input_refused(tiny: Path, tmp_path: Path, capsys) -> None:
    assert main(["quantize", str(tiny), "-o", str(tmp_path / "q"), "--method", "rtn"]) == 0
    code, err = run(capsys, "quantize", str(tmp_path / "q"), "-o", str(tmp_path / "q2"), "--method", "rtn")
    assert code == 2 and "already compressed" in err and "start from a dense model" in err


def test_interrupted_run_leaves_no_loadable_half_output(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "q"
    real = methods.METHODS["rtn"]
    calls = {"n": 0}

    def dies_on_second_layer(job):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real.layer(job)

    monkeypatch.setitem(methods.METHODS, "rtn", replace(real, layer=dies_on_second_layer))
    with pytest.raises(KeyboardInterrupt):
        main(["quantize", str(tiny), "-o", str(out), "--method", "rtn"])
    assert not out.exists()
    assert not list(tmp_path.iterdir())  # no temp dir left behind either
    with pytest.raises(UserError):
        compress.load(out)
    # an interrupted --overwrite keeps the previous complete output
    monkeypatch.setitem(methods.METHODS, "rtn", real)
    assert main(["quantize", str(tiny), "-o", str(out), "--method", "rtn", "--bits", "8"]) == 0
    monkeypatch.setitem(methods.METHODS, "rtn", replace(real, layer=dies_on_second_layer))
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        main(["quantize", str(tiny), "-o", str(out), "--method", "rtn", "--bits", "4", "--overwrite"])
    assert json.loads((out / "config.json").read_text())["quantization_config"]["memfit"]["bits"] == 8
    compress.load(out)


def test_python_dash_m_exit_code_and_stderr(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "compress", "quantize", str(tmp_path / "nope"), "-o",
                           str(tmp_path / "q")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "compress: error:" in proc.stderr and "is not a directory" in proc.stderr
    assert proc.stdout == ""
