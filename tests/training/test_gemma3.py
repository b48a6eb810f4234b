"""Gemma 3: the real-model LoRA recipe parses and fits, and its options train a tiny random Gemma 3 end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

from training.cli import main
from training.config import load_config
from training.tokenizer import train_bpe

from .conftest import WORDS, read_metrics

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "train" / "gemma3_lora.yaml"


def tiny_gemma3_config(vocab_size: int, bos: int = 1, eos: int = 2, pad: int = 0) -> Gemma3TextConfig:
    return Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        tie_word_embeddings=True,
    )


@pytest.fixture
def tiny_gemma3_dir(tmp_path: Path) -> Path:
    """A random 2-layer, 64-wide Gemma 3 (sliding + full attention, tied embeddings) saved with a tokenizer."""
    tok = train_bpe([" ".join(WORDS)] * 20, vocab_size=300)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(tiny_gemma3_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id))
    d = tmp_path / "gemma3-tiny"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_gemma3_recipe_parses_and_validates():
    from compress.calib import HELD_OUT

    cfg = load_config(str(RECIPE))
    assert cfg.lora and not cfg.qlora and cfg.model_path == ".cache/models/gemma3-270m"
    assert sorted(cfg.val_files) == sorted(HELD_OUT)  # the plays every stage keeps out of training/calibration
    assert cfg.bos_per_block and cfg.eval_at_start
    # fp32 logits over Gemma's 262,144-token vocabulary stay under 1 GiB per micro-batch
    assert cfg.batch_size * cfg.block_size * 262_144 * 4 <= 2**30
    # every target is a module of Gemma 3 (attention and MLP projections)
    with torch.device("meta"):
        model = Gemma3ForCausalLM(tiny_gemma3_config(300))
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    assert set(cfg.lora_targets) <= names


def test_lora_on_tiny_gemma3_with_the_recipe_options(tiny_gemma3_dir, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    before = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir).state_dict()
    code = main(["--config", str(RECIPE), f"model_path={tiny_gemma3_dir}", f"data=[{corpus}]",
                 "val_files=[doc0.txt]", "block_size=32", "batch_size=4", "max_steps=6", "warmup_steps=1",
                 "lr=1e-2", "eval_every=3", "save_every=3", "eval_batches=0", f"output_dir={out}"])
    assert code == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    # eval_at_start: a step-0 row with the base model's loss; the adapters then lower it
    rows = read_metrics(out)
    assert rows[0]["step"] == 0 and "loss" not in rows[0]
    assert result["start_val_loss"] == pytest.approx(rows[0]["val_loss"], abs=1e-5)
    assert math.isfinite(result["val_loss"]) and result["val_loss"] < result["start_val_loss"]

    # the adapters trained: every LoRA B (initialised to zero) moved, for every target kind
    cfg = load_config(str(RECIPE))
    adapter = load_file(str(out / "last" / "adapter_model.safetensors"))
    lora_b = {k: v for k, v in adapter.items() if "lora_B" in k}
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b.values())
    assert {t for t in cfg.lora_targets if any(f".{t}." in k for k in lora_b)} == set(cfg.lora_targets)
    assert not (out / "last" / "model.safetensors").exists()  # the adapter alone, not a base copy

    # the merged model loads in plain transformers; only the targeted projections differ from the base
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert isinstance(merged, Gemma3ForCausalLM)
    after = merged.state_dict()
    assert set(after) == set(before)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(n.rsplit(".", 2)[-2] in cfg.lora_targets for n in changed)
    assert {n.rsplit(".", 2)[-2] for n in changed} == set(cfg.lora_targets)
    tok = AutoTokenizer.from_pretrained(out / "merged")
    ids = tok("the king", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(merged(input_ids=ids).logits).all()
