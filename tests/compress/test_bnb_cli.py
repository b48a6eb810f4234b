from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import compress
from compress.cli import main

from .conftest import logits

IDS = torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method,bits,layer", [("nf4", 4, "Linear4bit"), ("int8", 8, "Linear8bitLt")])
def test_bitsandbytes_round_trip(tiny: Path, tmp_path: Path, method: str, bits: int, layer: str) -> None:
    out = tmp_path / method
    assert main(["quantize", str(tiny), "-o", str(out), "--method", method, "--bits", str(bits)]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes" and qc["memfit"]["method"] == method
    model = compress.load(out)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == layer
    got = logits(model, IDS)
    fp = logits(AutoModelForCausalLM.from_pretrained(tiny), IDS)
    assert torch.isfinite(got).all()
    assert not torch.equal(got, fp)
    assert (got - fp).abs().max() < 0.5 * fp.abs().max()


def test_info_and_eval(tiny: Path, tmp_path: Path, eval_file: Path, capsys) -> None:
    out = tmp_path / "q"
    assert main(["quantize", str(tiny), "-o", str(out), "--method", "rtn"]) == 0
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "compressed-tensors" in text and "down_proj" in text
    assert main(["eval", str(out), "--baseline", str(tiny), "--text", str(eval_file), "--decode-tokens", "4",
                 "--seqlen", "64"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| model") and len(table) == 4
    ppl_fp, ppl_q = (float(row.split("|")[4]) for row in table[2:])
    assert 1 < ppl_fp < 400 and 1 < ppl_q < 400  # vocab 320: random-model perplexity is near 320
    assert [row.split("|")[-2].strip() for row in table[2:]] == ["serve", "serve"]  # llama: serve's engine
    assert main(["eval", str(out), "--text", str(eval_file), "--decode-tokens", "4", "--seqlen", "64",
                 "--decode-engine", "hf"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split("|")[-2].strip() == "hf"
    assert main(["eval", str(out), "--text", str(tmp_path / "missing.txt")]) == 2
