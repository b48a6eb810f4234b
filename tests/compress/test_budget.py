"""`compress quantize --max-size / --target-bits`: exact size prediction, the allocation fits and is monotone in
the budget, mixed-bit outputs load everywhere with the same logits, bad budgets are refused before any work."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import compress
from compress import budget, ctformat, sensitivity
from compress.cli import main
from compress.loader import load
from compress.quant import QuantArgs
from compress.rtn import rtn
from memfit.errors import UserError

from .conftest import logits, make_model_dir
from .test_architectures import make_arch_dir

CAL = ["--calib-samples", "4", "--calib-seqlen", "32", "--sensitivity-tokens", "64"]
IDS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def run(src: Path, out: Path, calib_file: Path, *args: str) -> int:
    return main(["quantize", str(src), "-o", str(out), "--method", "rtn", "--calib", str(calib_file), *CAL, *args])


def tensor_bytes(out: Path) -> int:
    """The safetensors file's size less its 8-byte length prefix and JSON header."""
    raw = (out / "model.safetensors").read_bytes()
    return len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]


def record(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["quantization_config"]


def check_loads(out: Path, serve_too: bool = False) -> None:
    """Plain transformers (compressed-tensors) and compress.load's fp32 reference agree exactly; the default
    kernels (int4 with bf16 activations) and serve's loader closely."""
    hf = logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), IDS)
    ref = logits(load(out, backend="dequant"), IDS)
    assert torch.allclose(ref, hf, atol=1e-4 * float(hf.abs().max()), rtol=0)
    assert (logits(compress.load(out), IDS) - hf).abs().mean() < 5e-2 * hf.abs().mean()
    if serve_too:
        from serve.loader import load as serve_load

        assert (logits(serve_load(str(out)).model, IDS) - hf).abs().mean() < 5e-2 * hf.abs().mean()


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("untied") / "fp", tie=False)


@pytest.fixture(scope="module")
def measured(untied: Path, calib_file: Path, tmp_path_factory) -> tuple[Path, Path]:
    """One budgeted run on the untied model: (its output, its saved sensitivities)."""
    d = tmp_path_factory.mktemp("budget")
    out, sens = d / "q", d / "sens.json"
    assert run(untied, out, calib_file, "--target-bits", "5", "--sensitivity", str(sens)) == 0
    return out, sens


def test_stored_bytes_is_what_tensors_for_writes() -> None:
    w = torch.randn(48, 96)
    for bits in (2, 3, 4, 8):
        for g, sym in ((32, False), (96, True), (8, False)):
            t = ctformat.tensors_for("m", rtn(w, QuantArgs(bits, g, sym)))
            assert ctformat.stored_bytes(48, 96, QuantArgs(bits, g, sym)) == sum(v.nbytes for v in t.values())


@pytest.mark.parametrize("text,n", [("123456", 123456), ("500MB", 500 * 10**6), ("80MiB", 80 * 2**20),
                                    ("1.5GiB", int(1.5 * 2**30)), ("2 kib", 2048), ("7b", 7)])
def test_parse_size(text: str, n: int) -> None:
    assert budget.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "MiB", "80 MiBs", "-5MB", "0", "1e3", "12 parsecs"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(UserError, match="--max-size"):
        budget.parse_size(text)


def test_allocation_fits_and_predicts_the_file_size(measured: tuple[Path, Path], untied: Path) -> None:
    out, _ = measured
    qc = record(out)
    b = qc["memfit"]["budget"]
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(untied).parameters())
    assert b["max_bytes"] == int(params * 5 / 8) and b["predicted_bytes"] <= b["max_bytes"]
    assert b["predicted_bytes"] == tensor_bytes(out)
    assert qc["memfit"]["bits"] == "mixed" and len(qc["config_groups"]) >= 2
    widths = {g["weights"]["num_bits"] for g in qc["config_groups"].values()}
    assert len(widths) >= 2 and "lm_head" in b["bits"]
    check_loads(out, serve_too=True)


def test_allocation_is_monotone_in_the_budget(measured: tuple[Path, Path], untied: Path) -> None:
    _, sens = measured
    kl = sensitivity.with_estimates({n: {int(k): v for k, v in per.items()}
                                     for n, per in json.loads(sens.read_text())["kl"].items()})
    model = budget.candidates(str(untied), [], 128, False, True)
    low = model.smallest()
    high = model.fixed_bytes + sum(max(c.nbytes for c in m.choices()) for m in model.candidates)
    prev = None
    for i in range(41):
        b = low + (high - low) * i // 40
        a = budget.allocate(model, kl, b)
        assert a.predicted_bytes <= b
        if prev is not None:
            assert all(a.choice[n].nbytes >= prev.choice[n].nbytes for n in a.choice)
            assert a.kl <= prev.kl and a.predicted_bytes >= prev.predicted_bytes
        prev = a
    assert {c.bits for c in prev.choice.values()} != {2}  # the sweep really moved up


def test_sensitivity_file_is_reused(measured: tuple[Path, Path], untied: Path, calib_file: Path, tmp_path: Path,
                                    monkeypatch) -> None:
    _, sens = measured

    def no(*_a, **_k):
        raise AssertionError("measured again")

    monkeypatch.setattr(sensitivity, "measure", no)
    out = tmp_path / "q"
    assert run(untied, out, calib_file, "--max-size", "300kB", "--sensitivity", str(sens)) == 0
    assert record(out)["memfit"]["budget"]["predicted_bytes"] == tensor_bytes(out) <= 300_000
    with pytest.raises(AssertionError, match="measured again"):  # another group size: the file does not match
        run(untied, tmp_path / "q2", calib_file, "--max-size", "300kB", "--sensitivity", str(sens),
            "--group-size", "32")


def test_budget_below_the_smallest_size_is_refused(tiny: Path, calib_file: Path, tmp_path: Path, capsys,
                                                   monkeypatch) -> None:
    monkeypatch.setattr(sensitivity, "measure", lambda *_a, **_k: pytest.fail("measured"))
    out = tmp_path / "q"
    assert run(tiny, out, calib_file, "--max-size", "100kB") == 2
    err = capsys.readouterr().err
    assert "--max-size 100kB (0.10 MiB) is below the smallest achievable size, 0.18 MiB (189,408 bytes" in err
    assert "every decoder-layer Linear at 2 bits, lm_head tied to the fp16 embedding" in err
    assert not out.exists()
    assert run(tiny, out, calib_file, "--target-bits", "1") == 2 and not out.exists()
    assert "bits per parameter" in capsys.readouterr().err


@pytest.mark.parametrize("extra,msg", [(["--bits", "4"], "--bits cannot be combined"),
                                       (["--method", "nf4"], "method nf4 is bitsandbytes"),
                                       (["--max-size", "1MB"], "not allowed with argument")])
def test_budget_flag_errors(tiny: Path, calib_file: Path, tmp_path: Path, capsys, extra: list[str],
                            msg: str) -> None:
    assert run(tiny, tmp_path / "q", calib_file, "--target-bits", "6", *extra) == 2
    assert msg in capsys.readouterr().err and not (tmp_path / "q").exists()


def test_tied_model_keeps_its_table_and_loads(tiny: Path, calib_file: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "q"
    assert run(tiny, out, calib_file, "--max-size", "280KiB") == 0
    assert "lm_head: tied to the fp16 input embedding (kept)" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and "lm_head" in cfg["quantization_config"]["ignore"]
    assert cfg["quantization_config"]["memfit"]["budget"]["predicted_bytes"] == tensor_bytes(out) <= 280 * 1024
    check_loads(out)


def test_gemma3_text_budget(tmp_path: Path, calib_file: Path) -> None:
    src = make_arch_dir(tmp_path / "fp", "gemma3_text")
    out = tmp_path / "q"
    assert run(src, out, calib_file, "--target-bits", "7", "--sym") == 0
    qc = record(out)
    assert qc["memfit"]["budget"]["predicted_bytes"] == tensor_bytes(out) and len(qc["config_groups"]) >= 2
    check_loads(out)
