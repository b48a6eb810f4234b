"""Tiny corpora and configs: every training test runs a 2-layer, 64-wide Llama on CPU in seconds."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from training.config import TrainConfig

WORDS = ("thou art the king of all the realm and I thy humble servant speak "
         "what light through yonder window breaks it is the east and juliet is the sun").split()

TINY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def write_corpus(root: Path, n_docs: int = 6, words_per_doc: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        text = " ".join(rng.choice(WORDS) for _ in range(words_per_doc))
        (root / f"doc{i}.txt").write_text(text + "\n")
    return root


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def make_cfg(tmp_path: Path, corpus: Path):
    def make(**overrides) -> TrainConfig:
        values = dict(model_config=dict(TINY_MODEL), vocab_size=320, data=[str(corpus)], val_files=["doc0.txt"],
                      block_size=32, batch_size=4, max_steps=6, lr=3e-3, warmup_steps=2, eval_every=3,
                      save_every=3, log_every=1, output_dir=str(tmp_path / "run"))
        values.update(overrides)
        return TrainConfig(**values).validate()
    return make


def read_metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_lora_outputs(out_dir: Path, before: dict[str, torch.Tensor]) -> None:
    """A LoRA run's output: the adapter alone in last/, and a merged model in which only q/k/v/o changed."""
    from transformers import AutoModelForCausalLM

    adapter = out_dir / "last"
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "model.safetensors").exists()
    after = AutoModelForCausalLM.from_pretrained(out_dir / "merged").state_dict()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(any(t in n for t in ("q_proj", "k_proj", "v_proj", "o_proj")) for n in changed)
