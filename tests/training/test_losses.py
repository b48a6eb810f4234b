"""Chunked (fused linear) cross-entropy: same loss and gradients as the plain path, without [tokens, vocab] memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from memfit.errors import UserError
from training.losses import chunked_causal_lm_loss, fused_linear_cross_entropy, plain_causal_lm_loss
from training.memory import ActivationMeter

from .conftest import TINY_MODEL

V, H, B, T, CHUNK = 1000, 32, 2, 37, 16  # 74 tokens: 4 full chunks of 16 and a ragged one of 10
FP32 = dict(rtol=1e-5, atol=1e-5)


def plain(h, w, y, b=None, softcap=None):
    z = F.linear(h, w, b).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z.flatten(0, -2), y.flatten(), ignore_index=-100, reduction="sum")


def make_inputs(seed=0, mask=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    b = torch.randn(V, generator=g) * 0.1
    y = torch.randint(0, V, (B, T), generator=g)
    if mask:
        y[0, 16:32] = -100  # flat tokens 16..31: one whole chunk ignored
        y[1, ::5] = -100  # and scattered ignored tokens elsewhere
    return h, w, b, y


def grads_of(fn, *tensors):
    """(loss, grads) of fn(*leaves) where leaves are fresh copies; None for tensors not requiring grad."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_matches_plain_loss_and_grads_fp32(use_bias, softcap):
    h, w, b, y = make_inputs()
    h.requires_grad_(), w.requires_grad_(), b.requires_grad_(use_bias)
    ref = grads_of(lambda h, w, b: plain(h, w, y, b if use_bias else None, softcap), h, w, b)
    got = grads_of(lambda h, w, b: fused_linear_cross_entropy(h, w, y, bias=b if use_bias else None,
                                                              softcap=softcap, chunk_tokens=CHUNK), h, w, b)
    assert got[0].dtype == torch.float32 and got[0].ndim == 0
    torch.testing.assert_close(got[0], ref[0], **FP32)
    for g, r in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(g, r, **FP32)
    assert got[1][0][0, 16:32].abs().max() == 0  # ignored tokens get no gradient


def test_frozen_weight_and_constant_hidden():
    h, w, _, y = make_inputs()
    # LoRA-style frozen lm_head: no weight gradient, hidden gradient still right
    ref = grads_of(lambda h, w: plain(h, w, y), h.requires_grad_(), w)
    got = grads_of(lambda h, w: fused_linear_cross_entropy(h, w, y, chunk_tokens=CHUNK), h, w)
    torch.testing.assert_close(got[0], ref[0], **FP32)
    torch.testing.assert_close(got[1][0], ref[1][0], **FP32)
    assert got[1][1] is None
    # and the other way round: only the weight learns
    ref = grads_of(lambda h, w: plain(h, w, y), h.detach(), w.requires_grad_())
    got = grads_of(lambda h, w: fused_linear_cross_entropy(h, w, y, chunk_tokens=CHUNK), h.detach(), w)
    torch.testing.assert_close(got[1][1], ref[1][1], **FP32)


def test_no_grad_gives_the_loss():
    h, w, b, y = make_inputs()
    with torch.no_grad():
        got = fused_linear_cross_entropy(h, w, y, bias=b, chunk_tokens=CHUNK)
    torch.testing.assert_close(got, plain(h, w, y, b), **FP32)


def test_all_ignored_is_zero():
    h, w, _, y = make_inputs()
    h.requires_grad_()
    loss = fused_linear_cross_entropy(h, w, torch.full_like(y, -100), chunk_tokens=CHUNK)
    loss.backward()
    assert loss.item() == 0 and h.grad.abs().max() == 0


def test_tied_embeddings():
    """The embedding table is also the lm_head: its gradient sums both uses, as with the plain loss."""
    torch.manual_seed(0)
    emb, proj = torch.nn.Embedding(V, H), torch.nn.Linear(H, H)
    ids = torch.randint(0, V, (B, T))
    y = make_inputs()[3]

    def run(loss_fn):
        emb.zero_grad(set_to_none=True), proj.zero_grad(set_to_none=True)
        loss = loss_fn(torch.tanh(proj(emb(ids))), emb.weight, y)
        loss.backward()
        return loss.detach(), emb.weight.grad.clone(), proj.weight.grad.clone()

    ref = run(plain)
    got = run(lambda h, w, y: fused_linear_cross_entropy(h, w, y, chunk_tokens=CHUNK))
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, **FP32)


def test_autocast_bf16_matches_plain_under_autocast():
    h, w, b, y = make_inputs()
    h.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = grads_of(lambda h, w, b: plain(h, w, y, b, softcap=3.0), h, w, b)
        got = grads_of(lambda h, w, b: fused_linear_cross_entropy(h, w, y, bias=b, softcap=3.0,
                                                                  chunk_tokens=CHUNK), h, w, b)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=0)
    for g, r in zip(got[1], ref[1], strict=True):
        assert g.dtype == r.dtype == torch.float32  # gradients come back in the inputs' dtype
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2 * r.abs().max().item())


def test_saves_no_tokens_by_vocab_tensor():
    n, vocab = 512, 50_000
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.randn(vocab, H) * 0.1)
    h = torch.randn(n, H, requires_grad=True)
    y = torch.randint(0, vocab, (n,))
    with ActivationMeter(holder) as fused:
        loss = fused_linear_cross_entropy(h, holder.w, y, chunk_tokens=64)
    loss.backward()
    with ActivationMeter(holder) as dense:
        plain(h, holder.w, y)
    full = n * vocab * 4
    assert dense.bytes >= full  # the meter sees the plain path's fp32 logits...
    assert fused.bytes < full / 4  # ...and the fused path keeps only an h-sized and a W-sized gradient


# --- Hugging Face models -------------------------------------------------------------------------------------


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=320, tie_word_embeddings=tied, **TINY_MODEL))


def tiny_gemma3(softcap: float) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=128, tie_word_embeddings=True, final_logit_softcapping=softcap))


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 320, (B, T), generator=g)
    y = torch.randint(0, 320, (B, T), generator=g)
    y[0, :20] = -100
    return x, y


def compare_models(model, rtol=1e-4, atol=1e-5):
    """Loss and every trainable gradient of plain vs chunked; atol is relative to each gradient's largest entry."""
    x, y = batch()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    results = []
    for loss_fn in (plain_causal_lm_loss, lambda m, x, y: chunked_causal_lm_loss(m, x, y, chunk_tokens=CHUNK)):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, x, y)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in params}))
    (ref_loss, ref), (got_loss, got) = results
    torch.testing.assert_close(got_loss, ref_loss, rtol=rtol, atol=atol)
    assert got.keys() == ref.keys() and got
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=rtol, atol=atol * ref[n].abs().max().item(),
                                   msg=lambda m, n=n: f"{n}: {m}")
    return got


@pytest.mark.parametrize("tied", [True, False])
def test_llama_chunked_matches_plain(tied):
    compare_models(tiny_llama(tied))


def test_gemma3_with_softcap_matches_plain():
    # small softcap so that it matters for a tiny random model's small logits
    model = tiny_gemma3(softcap=0.5)
    x, y = batch()
    with torch.no_grad():
        assert model(input_ids=x).logits.abs().max() > 0.25
    compare_models(model)


def test_peft_lora_chunked_matches_plain():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(tied=False),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    # B starts at zero; give it values so the LoRA A matrices get non-zero gradients too
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    grads = compare_models(model)
    assert grads and all("lora_" in n for n in grads)


def test_bf16_autocast_model_matches_plain():
    model = tiny_gemma3(softcap=0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compare_models(model, rtol=3e-2, atol=3e-2)


def test_logit_postprocessing_is_detected():
    model = tiny_llama(tied=False)
    x, y = batch()
    # a model that scales its logits (like Cohere's logit_scale): our lm_head(hidden) would disagree
    handle = model.lm_head.register_forward_hook(lambda _m, _a, out: out * 2)
    with pytest.raises(UserError, match="logits are not lm_head"):
        chunked_causal_lm_loss(model, x, y)
    handle.remove()
    # a softcap the config claims but the model doesn't apply (Llama ignores final_logit_softcapping)
    model = tiny_llama(tied=False)
    model.config.final_logit_softcapping = 0.5
    with pytest.raises(UserError, match="logits are not lm_head"):
        chunked_causal_lm_loss(model, x, y)


def test_lora_on_lm_head_is_refused():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(tied=False), LoraConfig(r=4, target_modules=["lm_head"]))
    x, y = batch()
    with pytest.raises(UserError, match="lm_head"):
        chunked_causal_lm_loss(model, x, y)
