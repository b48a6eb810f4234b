"""Tiny random Llama dirs (with a real BPE tokenizer) built in seconds, no downloads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ("the king queen lord love death night day sword crown blood fair sweet heart time hand eye "
         "speak hear come go make give take know think good noble honest false true man woman").split()


def fake_text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    while n_words > 0:
        k = rng.randint(4, 12)
        lines.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + rng.choice(".,;!?"))
        n_words -= k
    return "\n".join(lines) + "\n"


def make_tokenizer(text: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


def make_model_dir(dest: Path, hidden: int = 128, inter: int = 320, layers: int = 2, tie: bool = True,
                   seed: int = 0) -> Path:
    text = fake_text(3000, seed=1)
    tok = make_tokenizer(text)
    cfg = LlamaConfig(vocab_size=320, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=tie, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a few outlier input channels, like trained LMs have: gives AWQ/GPTQ something to do
        for layer in model.model.layers:
            layer.input_layernorm.weight[:4] = 8.0
            layer.post_attention_layernorm.weight[:4] = 8.0
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """hidden 128, intermediate 320 (group 128 does not divide it: exercises the fallback), GQA, tied."""
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "fp")


@pytest.fixture(scope="session")
def calib_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text(fake_text(6000, seed=2))
    return p


@pytest.fixture(scope="session")
def eval_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("evaltext") / "eval.txt"
    p.write_text(fake_text(1500, seed=3))
    return p


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()
