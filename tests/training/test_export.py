import json
import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.export import export
from training.generate import main as generate_main
from training.loop import train

from .conftest import read_metrics

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "shakespeare-llama"
# Hamlet is one of the held-out plays: the shipped model never trained on this text.
HAMLET = ("HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
          "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles,\n")


def test_export_writes_clean_model_dir_with_card_from_metrics(make_cfg, tmp_path):
    cfg = make_cfg(max_steps=6, eval_every=3)
    train(cfg)
    dest = export(Path(cfg.output_dir), tmp_path / "exported", command="train --config tiny.yaml")
    names = {p.name for p in dest.iterdir()}
    assert "model.safetensors" in names and "tokenizer.json" in names and "README.md" in names
    assert not names & {"training_state.json", "training_state.safetensors", "best.json"}
    best = min((r for r in read_metrics(cfg.output_dir) if "val_loss" in r), key=lambda r: r["val_loss"])
    card = (dest / "README.md").read_text()
    assert f"{best['val_loss']:.4f}" in card and "train --config tiny.yaml" in card
    assert json.loads((dest / "generation_config.json").read_text())["do_sample"] is True
    AutoModelForCausalLM.from_pretrained(dest)


def test_shipped_model_loads_with_plain_transformers_and_knows_shakespeare(capsys):
    model = AutoModelForCausalLM.from_pretrained(SHIPPED).eval()
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    ids = tok(HAMLET, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 0.75 * math.log(len(tok))  # far better than a uniform guess on unseen Shakespeare
    assert generate_main(["--model", str(SHIPPED), "--prompt", "ROMEO. ", "--max-new-tokens", "20"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ROMEO. ") and len(out) > len("ROMEO. ") + 10


def test_load_pretrained_never_swaps_in_hub_kernels():
    # transformers turns hub kernels on by default where its `kernels` package is installed (a dependency of
    # transformers >= 5.2x); they are code fetched from the Hub at load, on GPU, which memfit never does
    from memfit.hf import load_pretrained

    model = load_pretrained("models/shakespeare-llama")
    assert model.use_kernels is False
    model.train()  # train mode re-kernelizes a model that uses kernels
    assert model.use_kernels is False and model.kernels_mode is None
