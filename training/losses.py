"""Causal-LM training losses: the plain one, and a chunked (fused linear + cross-entropy) one.

Why: the plain loss materialises logits for every token, [tokens, vocab]. With Gemma 3's 262,144-token
vocabulary at 4 x 1024 tokens that is ~4 GiB of bf16 logits, plus an fp32 copy, plus the log-softmax and
its gradient. ``fused_linear_cross_entropy`` (the idea of Liger-Kernel's fused linear cross entropy)
never builds that tensor: it walks the tokens in chunks and, still in the FORWARD pass, computes each
chunk's logits, its loss and at once the gradients of the loss w.r.t. the hidden states and lm_head weight
(d loss / d logits = softmax - onehot, known without a backward pass). Backward then only scales those
stored gradients by the incoming scalar. Same 3 matmuls per chunk as the plain forward + backward, no
recompute; extra memory is O(chunk_tokens x vocab) plus one hidden-sized and one weight-sized gradient.

``chunked_causal_lm_loss`` applies it to a Hugging Face causal LM (possibly PEFT/DDP-wrapped): a forward
hook on the decoder captures the final hidden state while the model itself computes logits for the last
position only (``logits_to_keep=1``), which also serves to check that the model's logits really are
``lm_head(hidden)`` (+ softcap) before we trust our own.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from memfit.errors import UserError
from training.model import base_model

_LOW_PRECISION = (torch.bfloat16, torch.float16)
CHUNK_LOGIT_BYTES = 256 * 2**20
"""Auto chunk size: ~256 MiB of fp32 logits per chunk (Gemma 3's 262,144 vocab: 256 tokens; 32k: 2048).
Smaller chunks re-read lm_head's weight more often (it is read once per chunk per pass)."""


def auto_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk for `loss_chunk_tokens: 0`: a power of two in [16, 4096] near CHUNK_LOGIT_BYTES."""
    tokens = max(16, min(4096, CHUNK_LOGIT_BYTES // (4 * vocab)))
    return 1 << (tokens.bit_length() - 1)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, softcap, chunk_tokens, ignore_index, compute_dtype,
                need_h, need_w, need_b):
        # Autocast off: compute_dtype already says what autocast would have picked; letting it cast
        # again inside (e.g. our fp32 softmax back to bf16) would be wrong.
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute_dtype)  # cast once (autocast would cache the same copy)
            b = None if bias is None else bias.to(compute_dtype)
            n = hidden.shape[0]
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(hidden) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
            for s in range(0, n, chunk_tokens):
                h = hidden[s:s + chunk_tokens].to(compute_dtype)
                y = labels[s:s + chunk_tokens]
                # Like the plain path: matmul in compute_dtype, then log-softmax in fp32.
                z = F.linear(h, w, b).float()
                if softcap is not None:
                    t = torch.tanh(z / softcap)
                    z = t * softcap
                lse = torch.logsumexp(z, dim=-1)
                valid = y != ignore_index
                target = y.clamp(min=0).unsqueeze(1)  # ignored rows gather a dummy column, masked below
                loss += ((lse - z.gather(1, target).squeeze(1)) * valid).sum()
                if not (need_h or need_w or need_b):
                    continue
                # d(sum CE)/dz = softmax(z) - onehot(y), zero rows for ignored labels. Reuse z's buffer.
                g = z.sub_(lse.unsqueeze(1)).exp_()
                g.scatter_add_(1, target, torch.full_like(target, -1, dtype=g.dtype))
                g.mul_(valid.unsqueeze(1))
                if softcap is not None:
                    g.mul_(1 - t * t)  # d(c * tanh(x / c))/dx = 1 - tanh^2
                    del t
                if need_b:
                    grad_b += g.sum(0)
                g = g.to(compute_dtype)  # the plain path's fp32 -> bf16 cast of the logits' gradient
                if need_h:
                    grad_h[s:s + chunk_tokens] = g @ w
                if need_w:
                    grad_w += (g.t() @ h).float()  # per chunk in compute_dtype, accumulated in fp32
                del z, g
        # Stored in the inputs' dtypes: the memory of one more copy of h (and W), never tokens x vocab.
        ctx.save_for_backward(
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
        )
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        # The loss is linear in its per-token terms' sum: the stored gradients times the incoming scalar.
        grads = [None if t is None else t * grad_out.to(t.dtype) for t in ctx.saved_tensors]
        return *grads, None, None, None, None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                               bias: torch.Tensor | None = None, softcap: float | None = None,
                               chunk_tokens: int = 1024, ignore_index: int = -100) -> torch.Tensor:
    """fp32 scalar SUM over tokens with ``labels != ignore_index`` of CE(softcap(hidden @ weight.T + bias), labels).

    hidden [..., H], weight [V, H], labels [...] (same leading shape). Equal (up to rounding) to the plain
    ``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels, reduction="sum")`` and its gradients,
    under autocast too (matmuls in the autocast dtype, softmax in fp32), but never holding more than
    ``chunk_tokens`` rows of logits.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if y.shape[0] != h.shape[0]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        compute_dtype = torch.get_autocast_dtype(dev)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    # Gradients are computed in forward, so decide here which are wanted (none under no_grad).
    grad = torch.is_grad_enabled()
    need_b = grad and bias is not None and bias.requires_grad
    return _FusedLinearCE.apply(h, weight, bias, y, softcap, chunk_tokens, ignore_index, compute_dtype,
                                grad and h.requires_grad, grad and weight.requires_grad, need_b)


def plain_causal_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Loss SUM the plain way: full logits, CE in fp32. ``labels`` are already shifted (y[t] follows x[t])."""
    logits = model(input_ids=input_ids).logits
    # CE in fp32 whatever autocast did: low-precision log-softmax over the vocab loses accuracy.
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def _parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear, float | None]:
    base = base_model(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    if not isinstance(decoder, torch.nn.Module):
        raise UserError(f"loss: chunked: can't find the decoder of {type(base).__name__}; set loss=plain")
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    # A plain float nn.Linear only: a LoRA-wrapped or quantized lm_head has a weight that is not the
    # whole story (and with LoRA B=0 at init the logits check below would pass until training moved it).
    if (not isinstance(head, torch.nn.Linear) or hasattr(head, "base_layer")
            or not head.weight.is_floating_point()):
        raise UserError(f"loss: chunked: {type(base).__name__}'s lm_head is {type(head).__name__}, not a plain "
                        "float nn.Linear (LoRA on lm_head? quantized?); set loss=plain")
    if "logits_to_keep" not in inspect.signature(base.forward).parameters:
        raise UserError(f"loss: chunked: {type(base).__name__}.forward does not take logits_to_keep; "
                        "set loss=plain")
    cfg = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    return decoder, head, getattr(cfg, "final_logit_softcapping", None)


def chunked_causal_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor,
                           chunk_tokens: int = 0) -> torch.Tensor:
    """Same loss SUM as ``plain_causal_lm_loss`` without materialising the [tokens, vocab] logits.

    ``model`` is called as given (so DDP/PEFT/accelerate wrappers and their hooks run) with
    ``logits_to_keep=1``; a forward hook on the decoder captures the final hidden state for the loss.
    chunk_tokens 0: auto_chunk_tokens(vocab).
    """
    decoder, head, softcap = _parts(model)
    captured: list[torch.Tensor] = []

    def hook(_module, _args, output):
        captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = decoder.register_forward_hook(hook)
    try:
        out = model(input_ids=input_ids, logits_to_keep=1)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise UserError(f"loss: chunked: the decoder ran {len(captured)} times in one forward; set loss=plain")
    hidden = captured[0]

    # Safety check: the model's own logits for the last position must be lm_head(hidden) (+ softcap);
    # if the model scales or otherwise post-processes its logits, our loss would silently be wrong.
    with torch.no_grad():
        ours = F.linear(hidden[:, -1], head.weight, head.bias).float()  # same autocast as the model's
        if softcap is not None:
            ours = softcap * torch.tanh(ours / softcap)
        ref = out.logits[:, -1].float()
        low = out.logits.dtype in _LOW_PRECISION or hidden.dtype in _LOW_PRECISION
        tol = 2e-2 if low else 1e-4
        scale = float(ref.abs().max().clamp(min=1.0))  # tolerance relative to the logits' scale
        if ours.shape != ref.shape or not torch.allclose(ours, ref, rtol=tol, atol=tol * scale):
            raise UserError(f"loss: chunked: this model's logits are not lm_head(final hidden state) "
                            f"(max difference {float((ours - ref).abs().max()):.3g} at logit scale {scale:.3g}: "
                            "a logit scale or other post-processing?); set loss=plain")
    del out
    if torch.is_autocast_enabled(hidden.device.type):
        # The model's last-position logits cast lm_head's weight to the autocast dtype, and autocast keeps that
        # copy (and, with checkpointing, each layer's) until the context exits: drop them before the loss makes
        # its own (Gemma 3 270M: 320 MiB of lm_head alone). What backward needs holds its own reference.
        torch.clear_autocast_cache()
    return fused_linear_cross_entropy(hidden, head.weight, labels, bias=head.bias, softcap=softcap,
                                      chunk_tokens=chunk_tokens or auto_chunk_tokens(head.weight.shape[0]))
