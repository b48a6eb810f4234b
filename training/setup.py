"""Everything the loop needs, built from a TrainConfig: data, tokenizer, model, optimizer, schedule."""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.errors import UserError
from memfit.hf import load_pretrained, load_tokenizer, nf4_config
from memfit.modeldir import atomic_dir
from training import checkpoint as ckpt
from training.config import TrainConfig
from training.data import pack, read_documents, split_documents
from training.model import build_llama
from training.tokenizer import document_texts, train_bpe


@dataclass
class Data:
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    n_train_docs: int
    n_val_docs: int


def prepare_output_dir(out: Path, resume: bool, overwrite: bool) -> Path | None:
    """Refuse to clobber a previous run; return the checkpoint to resume from (if resuming)."""
    if resume:
        found = ckpt.find_checkpoint(out / "last")
        if found is None:
            raise UserError(f"--resume: no complete checkpoint in {out}/last to resume from")
        return found
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise UserError(
                f"output_dir: {out} holds a previous run; pass --resume to continue it or --overwrite to replace it"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return None


def get_tokenizer(cfg: TrainConfig, out: Path, train_docs, accelerator):
    if cfg.tokenizer_path:
        return load_tokenizer(cfg.tokenizer_path, cfg.trust_remote_code)
    if cfg.model_path:
        return load_tokenizer(cfg.model_path, cfg.trust_remote_code)
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        if accelerator.is_main_process:
            tok = train_bpe(document_texts(d.row for d in train_docs), cfg.vocab_size)
            atomic_dir(tok_dir, tok.save_pretrained)
        accelerator.wait_for_everyone()
    return load_tokenizer(str(tok_dir))


def load_data(cfg: TrainConfig, tokenizer, train_docs, val_docs) -> Data:
    train_x, train_y = pack(train_docs, tokenizer, cfg.block_size, cfg.bos_per_block)
    if (train_y != -100).sum() == 0:
        raise UserError("data: no training targets after masking (every token is prompt/padding)")
    if val_docs:
        val_x, val_y = pack(val_docs, tokenizer, cfg.block_size, cfg.bos_per_block)
    else:
        val_x = val_y = torch.empty(0, cfg.block_size, dtype=torch.long)
    return Data(train_x, train_y, val_x, val_y, len(train_docs), len(val_docs))


def read_split(cfg: TrainConfig):
    return split_documents(read_documents(cfg.data), cfg.val_files, cfg.val_fraction)


def get_model(cfg: TrainConfig, tokenizer, resume_from: Path | None, device: torch.device):
    quant = None
    if cfg.qlora:
        if device.type != "cuda":
            raise UserError(
                "qlora: the 4-bit NF4 base needs CUDA (bitsandbytes 4-bit on CPU is ~12x slower than fp32); "
                "on CPU use lora=true with an fp32 base"
            )
        quant = nf4_config(torch.bfloat16, double_quant=True)
    if resume_from is not None and not cfg.lora:
        model = load_pretrained(str(resume_from))
    elif cfg.model_path:
        extra = {"quantization_config": quant, "device_map": {"": device}} if quant else {}
        model = load_pretrained(cfg.model_path, cfg.allow_pickle, cfg.trust_remote_code, **extra)
    else:
        model = build_llama(cfg.model_config or {}, tokenizer, cfg.seed)
    model.config.use_cache = False
    if cfg.lora or cfg.qlora:
        model = add_lora(model, cfg, resume_from)
    if cfg.checkpointing != "none":
        every = 1 if cfg.checkpointing == "full" else cfg.checkpoint_every_k
        model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every)
    return model


def add_lora(model, cfg: TrainConfig, resume_from: Path | None):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training, set_peft_model_state_dict
    from safetensors.torch import load_file

    if cfg.qlora:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    names = {n.split(".")[-1] for n, _ in model.named_modules()}
    missing = [t for t in cfg.lora_targets if t not in names]
    if missing:
        raise UserError(f"lora_targets: no module named {', '.join(missing)} in this model")
    lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_targets, task_type="CAUSAL_LM")
    torch.manual_seed(cfg.seed)
    model = get_peft_model(model, lcfg)
    if resume_from is not None:
        set_peft_model_state_dict(model, load_file(str(resume_from / "adapter_model.safetensors")))
    return model


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    if cfg.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(groups, **kwargs)
        except (ImportError, RuntimeError) as e:
            raise UserError(f"optimizer=adamw8bit: bitsandbytes is not usable here ({e})") from None
    return torch.optim.AdamW(groups, **kwargs)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then cosine down to min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
