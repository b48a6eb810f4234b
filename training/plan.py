"""`train --plan`: the memory a recipe will need, predicted from its parts before any step runs.

Parameters, gradients and optimizer state are counted from the model and the optimizer's rules;
activations are measured by one forward pass on a real micro-batch (training.memory.ActivationMeter,
with the recipe's checkpointing applied); the loss's transient tensors follow from the vocabulary,
the token count and the loss kind. The peak is when the most of these are alive at once:

    step 1:   base + max(activations + loss [+ gradients], gradients + max(recompute, embedding grad),
                         gradients + optimizer state + optimizer temporaries)
    later:    base + optimizer state + max(activations + loss [+ gradients], gradients + max(recompute, embedding
                                           grad), gradients + optimizer temporaries)

with [+ gradients] when grad_accum > 1 (a later micro-batch runs with the accumulated gradients alive).

`base` is what the process holds before the first step (interpreter, torch, data, tokenizer, the
weights): measured as RSS on CPU, as allocated bytes on CUDA. After step 1 the memory report puts the
prediction next to the measured peak.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass

import torch

from memfit.heap import release_free_memory, status_kib
from training.config import TrainConfig
from training.losses import auto_chunk_tokens
from training.memory import mib


@dataclass
class MemoryPlan:
    base: int
    """Bytes the process holds before step 1 (weights included): RSS on CPU, allocated on CUDA."""
    parameters: int
    """All weights, trainable or not."""
    gradients: int
    """One gradient per trainable weight, in the weight's dtype."""
    optimizer_state: int
    """AdamW moments (and the fp32 master copy with optimizer_offload), on the device or the CPU."""
    optimizer_on_device: bool
    """False when optimizer_offload moves the state to the CPU."""
    activations: int
    """Bytes one micro-batch's forward saves for backward (measured), less what is offloaded."""
    loss: int
    """Transient loss tensors not in `activations`: logits and their gradient (plain), one chunk's (chunked)."""
    recompute: int
    """The largest layer's saved bytes: alive again while a checkpointed layer is recomputed in backward."""
    embedding_grad: int = 0
    """End of backward, when the embedding trains: its dense [vocab, hidden] gradient, plus the sum with
    lm_head's gradient when the two are tied."""
    optimizer_temp: int = 0
    """AdamW's step temporaries: a copy of every trainable weight (foreach, CUDA) or two of the largest (CPU)."""
    accumulating: bool = False
    """grad_accum > 1: every micro-batch after the first runs its forward and backward with the accumulated
    gradients alive (Gemma 3 270M at 2 x 2: measured 1 GiB, its gradients, over a plan without this)."""
    embedding_tied: bool = False
    """The embedding and lm_head share the trained weight: accumulating, backward's sum of its two partial
    gradients is a third [vocab, hidden] tensor beside the accumulated one before it is added in (Gemma 3 270M
    at 1 x 4: measured 640 MiB, one vocabulary table, over a plan without this)."""

    @property
    def activation_phase(self) -> int:
        """Forward/backward of a micro-batch: its activations and loss, and the gradients accumulated so far."""
        return self.activations + self.loss + (self.gradients if self.accumulating else 0)

    @property
    def end_of_backward(self) -> int:
        """The gradients, with a checkpointed layer's recompute or the embedding's dense gradient(s) beside them."""
        extra = self.embedding_grad // 2 if self.accumulating and self.embedding_tied else 0
        return self.gradients + max(self.recompute, self.embedding_grad + extra)

    @property
    def device_optimizer(self) -> int:
        return self.optimizer_state if self.optimizer_on_device else 0

    @property
    def peak_first_step(self) -> int:
        return self.base + max(self.activation_phase, self.end_of_backward,
                               self.gradients + self.device_optimizer + self.optimizer_temp)

    @property
    def peak(self) -> int:
        return self.base + self.device_optimizer + max(self.activation_phase, self.end_of_backward,
                                                       self.gradients + self.optimizer_temp)

    def as_dict(self) -> dict:
        return asdict(self) | {"peak_first_step": self.peak_first_step, "peak": self.peak}

    def table(self) -> str:
        where = "" if self.optimizer_on_device else " (CPU, not in the peak)"
        rows = [("base (process before step 1, weights included)", self.base),
                ("parameters", self.parameters), ("gradients", self.gradients),
                (f"optimizer state{where}", self.optimizer_state),
                ("activations (one micro-batch)", self.activations), ("logits / loss transient", self.loss),
                ("checkpoint recompute", self.recompute), ("embedding gradient (end of backward)", self.embedding_grad),
                ("optimizer step temporaries", self.optimizer_temp), ("predicted peak, step 1", self.peak_first_step),
                ("predicted peak, later steps", self.peak)]
        width = max(len(r[0]) for r in rows)
        return "\n".join(f"{name:<{width}}  {mib(b):>12}" for name, b in rows)


def optimizer_bytes(cfg: TrainConfig, trainable: list[torch.Tensor]) -> int:
    n = sum(p.numel() for p in trainable)
    if cfg.optimizer == "adamw8bit":
        # bitsandbytes: two uint8 moments + one fp32 absmax per 256-value block; tensors < 4096 values stay fp32
        small = sum(p.numel() for p in trainable if p.numel() < 4096)
        return 2 * (n - small) + 2 * (n - small) // 256 * 4 + 8 * small
    state = sum(2 * p.numel() * p.element_size() for p in trainable)  # exp_avg + exp_avg_sq, the param's dtype
    if cfg.optimizer_offload == "cpu":
        state = 4 * 4 * n  # fp32 master, its fp32 gradient buffer and the two fp32 moments, all on the CPU
    return state


def embedding_grad_bytes(model: torch.nn.Module) -> tuple[int, bool]:
    """(MemoryPlan.embedding_grad, MemoryPlan.embedding_tied) of this model."""
    emb = model.get_input_embeddings().weight
    if not emb.requires_grad:
        return 0, False
    tied = emb is model.get_output_embeddings().weight
    return emb.numel() * emb.element_size() * (2 if tied else 1), tied


ADAMW8BIT_CPU_TEMP = 20.0
"""Bytes per element of the largest trainable tensor that bitsandbytes' AdamW8bit step holds on CPU (0.50.2,
measured 20-22 on 1M-16M-element tensors): with no CPU kernel it dequantizes both moments to fp32 and updates in
torch ops, one tensor at a time. `memfit fit` measures it instead (training.fit_child)."""


def optimizer_temp_bytes(cfg: TrainConfig, trainable: list[torch.Tensor], device: torch.device,
                         adamw8bit_cpu_temp: float = ADAMW8BIT_CPU_TEMP) -> int:
    if cfg.optimizer_offload != "none" or not trainable:
        return 0
    if cfg.optimizer == "adamw8bit":  # CUDA: fused 8-bit kernels, nothing beyond the state
        return 0 if device.type == "cuda" else round(adamw8bit_cpu_temp * max(p.numel() for p in trainable))
    if cfg.optimizer != "adamw":
        return 0
    if device.type == "cuda":  # torch picks the foreach AdamW there: one temporary list as big as the weights
        return sum(p.numel() * p.element_size() for p in trainable)
    return 2 * max(p.numel() * p.element_size() for p in trainable)  # per tensor: sqrt(v), then / its correction


def loss_bytes(cfg: TrainConfig, tokens: int, vocab: int, low_precision: bool, hidden: int = 0) -> int:
    """Transient bytes of the loss beyond what the activation probe saw (it counts log-softmax's output, and
    the chunked loss's stored gradients of the hidden states and lm_head). `hidden`: lm_head's input width."""
    if cfg.loss == "plain":
        # forward: the logits next to log-softmax's output; backward: the gradient of both (fp32); under
        # autocast the logits come in 2-byte form and are widened once more by `.float()`
        return tokens * vocab * (4 + 4 + (2 if low_precision else 0))
    chunk = min(tokens, cfg.loss_chunk_tokens or auto_chunk_tokens(vocab))
    # one chunk's logits, softmax-minus-onehot, and its compute-dtype copy; under autocast, lm_head's weight in
    # the compute dtype for the whole loss (Gemma 3 270M: 320 MiB)
    return 3 * chunk * vocab * 4 + (vocab * hidden * 2 if low_precision else 0)


def settled_bytes(device: torch.device) -> int:
    """What the process holds once garbage is collected and the allocator has returned free memory: the
    plan's `base`. Taken after the probe forward, which has read every weight (a safetensors checkpoint is
    mapped lazily: before a forward, untouched weight pages are not resident yet)."""
    gc.collect()
    if device.type == "cpu":
        release_free_memory()
    return process_bytes(device)


def process_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return status_kib("VmRSS") * 1024


def peak_bytes(device: torch.device) -> int:
    """The process's peak so far: VmHWM on CPU, max_memory_allocated on CUDA."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return status_kib("VmHWM") * 1024


def reset_peak(device: torch.device) -> None:
    """Start peak tracking now, so loading the model (which can briefly hold two copies) is not the peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: resets VmHWM to the current RSS
    except OSError:
        pass  # not Linux or not allowed: the peak then includes loading
