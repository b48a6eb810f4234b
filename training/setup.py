"""Everything the loop needs, built from a TrainConfig: data, tokenizer, model, optimizer, schedule."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from memfit.errors import UserError
from memfit.hf import load_pretrained, load_tokenizer, nf4_config
from memfit.modeldir import atomic_dir
from memfit.sizes import parse_size
from training import checkpoint as ckpt
from training.budget import apply_checkpointing, choose_checkpointing, find_decoder_layers, probe_layers
from training.config import TrainConfig
from training.data import pack, read_documents, split_documents
from training.model import build_llama
from training.offload import CPUOffloadAdamW
from training.plan import (
    MemoryPlan,
    embedding_grad_bytes,
    loss_bytes,
    optimizer_bytes,
    optimizer_temp_bytes,
    settled_bytes,
)
from training.precision import Precision
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
    return model


def plan_checkpointing(model, cfg: TrainConfig, run_forward: Callable[[], torch.Tensor] | None,
                       prec: Precision, device: torch.device, verbose: bool = False) -> MemoryPlan | None:
    """Checkpoint the layers the recipe asks for; with `run_forward` (a micro-batch's loss) first probe each
    layer's saved bytes and time: `checkpointing: auto` picks its layers from that, and the memory plan
    is built from it. Returns the plan when probed."""
    if cfg.checkpointing == "none" and run_forward is None:
        return None
    n = len(find_decoder_layers(model))
    chosen = {"none": [], "full": list(range(n)),
              "every_k": [i for i in range(n) if i % cfg.checkpoint_every_k == 0]}.get(cfg.checkpointing, [])
    mlp_chosen: list[int] = []
    plan = None
    if run_forward is not None:
        def forward() -> torch.Tensor:
            with prec.autocast():
                return run_forward()

        costs, other = probe_layers(model, forward)
        base = settled_bytes(device)
        activations = other + sum(c.boundary_bytes if c.index in chosen else c.saved_bytes for c in costs)
        if cfg.checkpointing == "auto":
            choice = choose_checkpointing(costs, other, parse_size(cfg.activation_budget, "activation_budget"))
            chosen, mlp_chosen, activations = choice.layers, choice.mlp_layers, choice.predicted_bytes
            if verbose:
                print("checkpointing: auto\n" + choice.table(), flush=True)
        trainable = [p for p in model.parameters() if p.requires_grad]
        head = model.get_output_embeddings().weight
        embedding_grad, embedding_tied = embedding_grad_bytes(model)
        if cfg.offload_activations != "none":
            activations = 0  # spilled (disk) or moved off the device (cpu); only tensors under 1 MiB stay
        plan = MemoryPlan(
            base=base, parameters=sum(p.numel() * p.element_size() for p in model.parameters()),
            gradients=sum(p.numel() * p.element_size() for p in trainable),
            optimizer_state=optimizer_bytes(cfg, trainable), optimizer_on_device=cfg.optimizer_offload == "none",
            activations=activations,
            loss=loss_bytes(cfg, cfg.batch_size * cfg.block_size, head.shape[0], prec.dtype is not None, head.shape[1]),
            recompute=max([c.saved_bytes for c in costs if c.index in chosen]
                          + [c.mlp_saved_bytes for c in costs if c.index in mlp_chosen], default=0),
            embedding_grad=embedding_grad, optimizer_temp=optimizer_temp_bytes(cfg, trainable, device),
            accumulating=cfg.grad_accum > 1, embedding_tied=embedding_tied)
        if verbose:
            print("memory plan (one micro-batch of "
                  f"{cfg.batch_size} x {cfg.block_size} tokens):\n{plan.table()}", flush=True)
    if chosen or mlp_chosen:
        apply_checkpointing(model, chosen, mlp_chosen)
    return plan


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


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device,
                   carry_from: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters only (frozen ones get no state). carry_from: a previous stage's
    optimizer whose per-parameter state continues for the parameters that still train."""
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

            opt = bnb.optim.AdamW8bit(groups, **kwargs)
        except (ImportError, RuntimeError) as e:
            raise UserError(f"optimizer=adamw8bit: bitsandbytes is not usable here ({e})") from None
    elif cfg.optimizer_offload == "cpu":
        if device.type == "cpu":
            raise UserError("optimizer_offload: cpu moves AdamW state off an accelerator; this run is on the CPU, "
                            "where the state already lives (use optimizer=adamw8bit or LoRA to shrink it)")
        opt = CPUOffloadAdamW(groups, **kwargs)
    else:
        opt = torch.optim.AdamW(groups, **kwargs)
    if carry_from is not None:
        for p in trainable:
            if p in carry_from.state:
                opt.state[p] = carry_from.state[p]
    return opt


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then cosine down to min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
