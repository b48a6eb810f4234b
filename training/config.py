"""Typed training config: YAML recipe + `key=value` overrides, validated with errors that name the key."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from memfit.errors import UserError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
CHECKPOINTING = ("none", "full", "every_k", "auto")
OPTIMIZERS = ("adamw", "adamw8bit")
LOSSES = ("chunked", "plain")
ACTIVATION_OFFLOAD = ("none", "cpu", "disk")
OPTIMIZER_OFFLOAD = ("none", "cpu")
STAGE_KEYS = ("steps", "trainable", "freeze")


@dataclass
class TrainConfig:
    # --- model ---
    model_path: str | None = None
    """Fine-tune this Hugging Face checkpoint dir (any AutoModelForCausalLM). Exclusive with model_config."""
    model_config: dict[str, Any] | None = None
    """Train from scratch: LlamaConfig keyword arguments (hidden_size, num_hidden_layers, ...)."""
    tokenizer_path: str | None = None
    """Tokenizer dir. Default: the model_path's tokenizer, or (from scratch) a BPE trained on the data."""
    vocab_size: int = 4096
    """Vocabulary size of the BPE tokenizer trained from scratch."""
    # --- data ---
    data: list[str] = field(default_factory=list)
    """Text files, dirs (every *.txt/*.jsonl inside) or globs. JSONL rows hold text, prompt/completion, or messages."""
    val_files: list[str] = field(default_factory=list)
    """File names (basenames) held out whole for validation. Empty: a val_fraction of documents by hash."""
    val_fraction: float = 0.05
    """Fraction of documents held out for validation when val_files is empty (deterministic, by document)."""
    block_size: int = 256
    """Tokens per packed training sequence."""
    bos_per_block: bool = False
    """Start every packed block with the tokenizer's bos token (then block_size - 1 text tokens, each still a
    target exactly once). Gemma needs it: its attention sinks on a leading <bos>, and blocks cut mid-document
    without one score far worse (Gemma 3 270M on Hamlet: 5.53 vs 4.23 nats/token). Llama-style models don't."""
    # --- optimisation ---
    batch_size: int = 8
    """Sequences per micro-batch per process."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; the loss is normalised by the token count over the whole window."""
    max_steps: int = 1000
    """Optimizer steps to train."""
    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at max_steps."""
    warmup_steps: int = 50
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms and biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    optimizer: str = "adamw"
    """adamw (torch) or adamw8bit (bitsandbytes 8-bit states: 4x less optimizer memory)."""
    seed: int = 1337
    """Seeds init, data order and dropout."""
    # --- memory knobs ---
    precision: str = "auto"
    """auto|fp32|bf16|fp16. auto: bf16 on CUDA with bf16, fp16+GradScaler on older CUDA, fp32 on CPU."""
    checkpointing: str = "none"
    """Activation checkpointing per decoder layer: none|full|every_k|auto (non-reentrant). auto measures each
    layer's saved bytes and forward time in one probe step and checkpoints the cheapest set of layers that keeps
    activations under activation_budget."""
    checkpoint_every_k: int = 2
    """With checkpointing=every_k: checkpoint every k-th decoder layer."""
    activation_budget: str | None = None
    """With checkpointing=auto: bytes of activations one micro-batch may keep for backward ("512MiB", "2GiB")."""
    loss: str = "chunked"
    """chunked: lm_head + cross-entropy over loss_chunk_tokens tokens at a time, gradients computed in the same
    pass, so the [tokens, vocab] logits never exist whole (equal gradients). plain: HF logits + F.cross_entropy."""
    loss_chunk_tokens: int = 0
    """Tokens per chunk of the chunked loss (its transient memory is ~3 x chunk x vocab x 4 bytes). 0: auto,
    chunks of ~256 MiB of fp32 logits (Gemma 3's 262k vocabulary: 256 tokens)."""
    offload_activations: str = "none"
    """none|cpu|disk. cpu (or true): saved activations go to pinned CPU memory during forward (GPU runs only).
    disk: they are spilled to files in a temp dir and read back in backward (for CPU-only runs)."""
    optimizer_offload: str = "none"
    """none|cpu. cpu: AdamW state and an fp32 master copy of the trainable weights live in CPU memory and the
    step runs there (ZeRO-Offload for one device); the device holds only weights and gradients."""
    trainable: list[str] = field(default_factory=list)
    """Regexes (re.search over parameter names): of the parameters that would train (all weights, or LoRA's
    adapters) only the matching ones do. Empty: all of them. A pattern that matches nothing is an error."""
    freeze: list[str] = field(default_factory=list)
    """Regexes of parameters to freeze (applied after trainable). The optimizer holds state only for what trains."""
    stages: list[dict[str, Any]] = field(default_factory=list)
    """Staged training: a list of {steps: N, trainable: [...], freeze: [...]}; each stage runs N optimizer steps
    (the last may omit steps: until max_steps) with its own patterns instead of the top-level ones."""
    lora: bool = False
    """Train LoRA adapters (PEFT) instead of all weights."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA alpha (scale = alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get adapters."""
    qlora: bool = False
    """LoRA on a 4-bit NF4 base (bitsandbytes). Needs CUDA."""
    # --- loop ---
    eval_every: int = 100
    """Evaluate validation loss/perplexity every N optimizer steps (and at the end)."""
    eval_batches: int = 0
    """Cap on validation micro-batches per eval (0 = the whole validation set)."""
    eval_at_start: bool = False
    """Also evaluate before the first step: a `step: 0` metrics row with the untrained (base) model's validation
    loss, the baseline a fine-tune's loss is compared with. Logged only (it never becomes the `best` checkpoint)."""
    save_every: int = 100
    """Write the `last` checkpoint every N steps (and at the end); `best` follows validation loss."""
    log_every: int = 10
    """Append a metrics.jsonl row every N steps."""
    output_dir: str = "runs/train"
    """Where checkpoints, metrics.jsonl and the tokenizer go."""
    allow_pickle: bool = False
    """Allow loading pickle `.bin` checkpoints (unsafe: pickle runs code)."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint dir."""

    def validate(self) -> TrainConfig:
        if (self.model_path is None) == (self.model_config is None):
            raise UserError("set exactly one of model_path (fine-tune) or model_config (from scratch)")
        if not self.data:
            raise UserError("data: no training data given (a list of files, dirs or globs)")
        _choice("precision", self.precision, PRECISIONS)
        _choice("checkpointing", self.checkpointing, CHECKPOINTING)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("loss", self.loss, LOSSES)
        if self.offload_activations in ("true", "True", "false", "False"):  # YAML booleans read as strings
            self.offload_activations = "cpu" if self.offload_activations.lower() == "true" else "none"
        _choice("offload_activations", self.offload_activations, ACTIVATION_OFFLOAD)
        _choice("optimizer_offload", self.optimizer_offload, OPTIMIZER_OFFLOAD)
        if self.optimizer_offload == "cpu" and self.optimizer != "adamw":
            raise UserError(f"optimizer_offload: cpu steps torch AdamW on the CPU; optimizer={self.optimizer} "
                            "keeps its state on the device and cannot offload (use optimizer=adamw)")
        if self.checkpointing == "auto" and not self.activation_budget:
            raise UserError("checkpointing: auto needs activation_budget (e.g. activation_budget=512MiB)")
        if self.activation_budget and self.checkpointing != "auto":
            raise UserError("activation_budget: only used with checkpointing=auto")
        _check_stages(self.stages, self.max_steps)
        for name in ("block_size", "batch_size", "grad_accum", "max_steps", "eval_every", "save_every",
                     "log_every", "checkpoint_every_k", "lora_r", "vocab_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.eval_batches < 0 or self.loss_chunk_tokens < 0:
            raise UserError("warmup_steps, eval_batches and loss_chunk_tokens must be >= 0")
        if not 0.0 <= self.val_fraction < 1.0:
            raise UserError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.lr <= 0:
            raise UserError(f"lr must be > 0, got {self.lr}")
        if self.qlora and self.model_path is None:
            raise UserError("qlora: needs a model_path (a pretrained base to quantize)")
        return self


def _check_stages(stages: list[dict[str, Any]], max_steps: int) -> None:
    for i, stage in enumerate(stages):
        where = f"stages[{i}]"
        if not isinstance(stage, dict):
            raise UserError(f"{where}: must be a mapping of {', '.join(STAGE_KEYS)}")
        unknown = sorted(set(stage) - set(STAGE_KEYS))
        if unknown:
            raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(STAGE_KEYS)})")
        steps = stage.get("steps")
        if steps is None and i != len(stages) - 1:
            raise UserError(f"{where}.steps: only the last stage may omit its length")
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
            raise UserError(f"{where}.steps must be an int >= 1, got {steps!r}")
        for key in ("trainable", "freeze"):
            pats = stage.get(key, [])
            if not isinstance(pats, list) or not all(isinstance(p, str) for p in pats):
                raise UserError(f"{where}.{key} must be a list of regexes")
    if stages and sum(s.get("steps") or 0 for s in stages[:-1]) >= max_steps:
        raise UserError(f"stages: the stages before the last add up to >= max_steps ({max_steps}): the last never runs")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UserError(f"{name}: {value!r} is not one of {', '.join(allowed)}")


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def _normalize(key: str, value: Any) -> Any:
    """Light coercions: `2e-3` (YAML 1.1 reads it as a string) to float, a lone string to a list."""
    hint = _HINTS.get(key)
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            value = float(value)
        except ValueError:
            pass
    if hint == list[str] and isinstance(value, str):
        value = [value]
    if hint is str and value is not None and not isinstance(value, str):
        value = str(value)
    if hint == str | None and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # activation_budget: 536870912
    return value


def _coerce(key: str, raw: str) -> Any:
    """Parse an override value with YAML, so `lr=1e-3`, `lora=true`, `data=[a,b]` all work."""
    try:
        return _normalize(key, yaml.safe_load(raw))
    except yaml.YAMLError as e:
        raise UserError(f"override {key}={raw!r}: not a valid value ({e})") from None


def _check_types(values: dict[str, Any], source: str) -> None:
    for key, value in values.items():
        if key not in _FIELDS:
            close = [k for k in _FIELDS if k.split("_")[0] == key.split("_")[0]]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UserError(f"{source}: unknown config key {key!r}{hint}")
        hint = _HINTS[key]
        ok = {
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, (int, float)) and not isinstance(value, bool),
            bool: isinstance(value, bool),
            str: isinstance(value, str),
        }.get(hint)
        if hint == str | None:
            ok = value is None or isinstance(value, str)
        elif hint == list[str]:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        elif hint == dict[str, Any] | None:
            ok = value is None or isinstance(value, dict)
        elif hint == list[dict[str, Any]]:
            ok = isinstance(value, list) and all(isinstance(v, dict) for v in value)
        if ok is False:
            raise UserError(f"{source}: {key} must be {getattr(hint, '__name__', hint)}, got {value!r}")


def load_config(path: str | None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML recipe (optional) and apply `key=value` overrides; unknown keys are an error."""
    values: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"--config: {path} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise UserError(f"--config: {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise UserError(f"--config: {path} must hold a mapping of config keys")
        loaded = {k: _normalize(k, v) for k, v in loaded.items()}
        _check_types(loaded, path)
        values.update(loaded)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise UserError(f"override {item!r}: expected key=value")
        key = key.strip().lstrip("-").replace("-", "_")
        if key not in _FIELDS:
            _check_types({key: None}, "override")
        value = _coerce(key, raw)
        _check_types({key: value}, "override")
        values[key] = value
    return TrainConfig(**values).validate()
