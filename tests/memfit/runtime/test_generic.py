"""The generic engine (memfit.runtime.generic) against HF's own forward and generate on tiny random decoders of
architectures (or features) the packed engine lacks, the factory's choice (GPT-2 and GPT-NeoX on the packed
engine: their greedy tokens too), and the refusal of models that are not causal decoders (exit 2 from `serve`,
naming the architecture)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from transformers import (
    BertConfig,
    BertLMHeadModel,
    BertModel,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
)

from memfit.errors import UserError
from memfit.runtime.generic import GENERIC, HFCacheModel, make_runner
from memfit.runtime.slot_model import Segment, SlotModel
from tests.serve.conftest import TEXT
from training.tokenizer import train_bpe

V = 300
_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=128, initializer_range=0.2)


def _model(kind: str, vocab: int = V) -> torch.nn.Module:
    """A tiny random decoder; initializer_range 0.2 so that greedy decoding does not repeat one token."""
    torch.manual_seed(0)
    if kind.startswith("gpt2"):  # gpt2-layerscale: attention scaled per layer, which only the generic engine runs
        m = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                       initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                                       scale_attn_by_inverse_layer_idx=kind == "gpt2-layerscale"))
    elif kind == "gpt_neox":
        m = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab, **_SIZES, bos_token_id=1, eos_token_id=2))
    elif kind.startswith("phi3"):  # Phi-3, with partial RoPE too, runs on the packed engine
        m = Phi3ForCausalLM(Phi3Config(vocab_size=vocab, **_SIZES, num_key_value_heads=2, pad_token_id=0,
                                       bos_token_id=1, eos_token_id=2,
                                       partial_rotary_factor=0.5 if kind == "phi3-partial" else 1.0))
    elif kind == "gemma2":  # every other layer a sliding window of 8: prompts here are longer. Gemma scales its
        # (tied) embeddings by sqrt(hidden): at 0.2 one token wins every step, so HF's default 0.02 here
        m = Gemma2ForCausalLM(Gemma2Config(vocab_size=vocab, **{**_SIZES, "initializer_range": 0.02},
                                           num_key_value_heads=2, head_dim=16, sliding_window=8, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2))
    elif kind == "llama":
        m = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, **_SIZES, num_key_value_heads=2))
    else:
        raise ValueError(kind)
    return m.eval()


KINDS = ["gpt2-layerscale", "gemma2"]  # on the generic engine
PACKED = ["gpt2", "gpt_neox", "phi3-partial"]  # adapted to the packed engine (memfit.runtime.archs)


@pytest.fixture(scope="module")
def tok():
    return train_bpe([TEXT] * 4, 400)


def _hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_and_decodes_match_hf_logits(kind):
    model = _model(kind)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(3, V, (23,), generator=g), torch.randint(3, V, (17,), generator=g)
    with torch.no_grad():
        ref_a, ref_b = model(a[None]).logits[0], model(b[None]).logits[0]
    sm = make_runner(model, 3, 64)
    assert isinstance(sm, HFCacheModel) and sm.engine == GENERIC and kind.split("-")[0] in sm.reason
    tol = dict(atol=1e-4, rtol=1e-4)
    # a's first chunk (no logits) with b's first chunk; then a decode-free mixed step, as the scheduler plans
    out = sm.forward(torch.cat([a[:9], b[:5]]), [Segment(2, 0, 9, want_logits=False), Segment(0, 0, 5)])
    torch.testing.assert_close(out[0], ref_b[4], **tol)
    out = sm.forward(torch.cat([b[5:6], a[9:22]]), [Segment(0, 5, 1, want_logits=False), Segment(2, 9, 13)])
    torch.testing.assert_close(out[0], ref_a[21], **tol)
    out = sm.forward(torch.cat([a[22:23], b[6:17]]), [Segment(2, 22, 1), Segment(0, 6, 11)])
    torch.testing.assert_close(out[0], ref_a[22], **tol)
    torch.testing.assert_close(out[1], ref_b[16], **tol)
    assert sm.lengths[:3] == [17, 0, 23] and sm.cache_bytes > 0
    assert out.dtype == torch.float32 and out.device.type == "cpu"


@pytest.mark.parametrize("kind", KINDS + PACKED)
def test_engine_greedy_tokens_equal_generate(kind, tok):
    """Through serve's Engine: 3 prompts on 2 slots (the third reuses a freed slot), prefill chunks of 5."""
    from serve.engine import Engine, Sequence
    from serve.sampling import SamplingParams

    model = _model(kind, len(tok))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (19, 11, 14)]
    refs = [_hf_greedy(model, p, 8) for p in prompts]
    assert len(set(refs[0])) > 1, "degenerate model: greedy repeats one token"
    sm = make_runner(model, 2, 64)
    assert isinstance(sm, HFCacheModel if kind in KINDS else SlotModel)
    eng = Engine(sm, tok, set(), prefill_chunk=5)
    done = [threading.Event() for _ in prompts]
    seqs = [Sequence(p, SamplingParams(temperature=0.0, max_tokens=8),
                     lambda ev, d=d: d.set() if ev.finish_reason else None, len(tok))
            for p, d in zip(prompts, done, strict=True)]
    try:
        eng.submit(seqs)
        assert all(d.wait(30) for d in done)
    finally:
        eng.stop()
    assert [s.finish_reason for s in seqs] == ["length"] * 3
    assert [s.out_ids for s in seqs] == refs


def test_slot_reuse_and_bad_segments():
    model = _model("gpt_neox")
    p = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(3))
    sm = HFCacheModel(model, 2, 16)
    first = sm.forward(p, [Segment(1, 0, 12)])
    sm.forward(torch.tensor([5, 6, 7]), [Segment(1, 12, 3)])
    again = sm.forward(p, [Segment(1, 0, 12)])  # a new sequence in the used slot starts from an empty cache
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    with pytest.raises(ValueError, match="cache holds 12"):
        sm.forward(torch.tensor([1]), [Segment(1, 13, 1)])
    with pytest.raises(ValueError, match="max_seq_len"):
        sm.forward(torch.tensor([1, 2, 3, 4, 5]), [Segment(1, 12, 5)])
    assert sm.lengths == [0, 12]  # refused before anything ran
    assert sm.forward(torch.tensor([4]), [Segment(1, 12, 1, want_logits=False)]).shape == (0, V)
    sm.clear_slot(1)
    assert sm.cache_bytes == 0 and sm.cache_bytes_per_device() == {}
    assert (sm.dense_packed, sm.ops, sm.int4_kernel, sm.prefetch.active, sm.prefetch.offloaded) == (0, None, 0,
                                                                                                    False, [])


def test_factory_picks_the_packed_engine_for_llama_and_refuses_tp_for_generic():
    assert isinstance(make_runner(_model("llama"), 2, 32), SlotModel)
    assert isinstance(make_runner(_model("phi3"), 2, 32), SlotModel)
    with pytest.raises(UserError, match="--tp: gpt2 with per-layer attention scaling"):
        make_runner(_model("gpt2-layerscale"), 2, 32, generic_ok=False)


def test_a_feature_the_packed_engine_lacks_falls_back_to_generic(monkeypatch):
    """SlotModel refusing a feature of a known architecture (UnsupportedModel) sends the model to the generic
    engine with that reason; its other errors stay the user's."""
    from memfit.runtime import generic
    from memfit.runtime.slot_model import UnsupportedModel

    def refuse(msg, kind=UserError):
        def init(*a, **k):
            raise kind(msg)
        return init

    model = _model("llama")
    monkeypatch.setattr(generic, "SlotModel", refuse("model: llama with X is not supported by the packed engine",
                                                     UnsupportedModel))
    sm = make_runner(model, 2, 32)
    assert isinstance(sm, HFCacheModel) and sm.reason == "llama with X is not supported by the packed engine"
    monkeypatch.setattr(generic, "SlotModel", refuse("--tp 3 must divide the attention heads"))
    with pytest.raises(UserError, match="--tp 3"):
        make_runner(model, 2, 32)


@pytest.mark.parametrize("kind", ["phi3", "phi3-partial"])
def test_phi3_fused_projections_it_cannot_split_run_fused_on_the_packed_engine(kind, tok):
    """A fused qkv_proj that is not a plain bias-free Linear (here: with a bias) is not split: the packed engine
    calls the fused projections themselves (with partial RoPE, their output columns reordered), and its greedy
    tokens equal HF's."""
    from serve.engine import Engine, Sequence
    from serve.sampling import SamplingParams

    model = _model(kind, len(tok))
    attn = model.model.layers[1].self_attn
    attn.qkv_proj.bias = torch.nn.Parameter(0.1 * torch.randn(attn.qkv_proj.out_features))
    fused = attn.qkv_proj
    ids = list(range(3, 20))
    want = _hf_greedy(model, ids, 6)
    sm = make_runner(model, 2, 64)
    assert isinstance(sm, SlotModel) and (sm.qkv[1].linear if kind == "phi3-partial" else sm.qkv[1]) is fused
    assert all(hasattr(ly.self_attn, "qkv_proj") and not hasattr(ly.self_attn, "q_proj") for ly in model.model.layers)
    done = threading.Event()
    seq = Sequence(ids, SamplingParams(temperature=0.0, max_tokens=6), lambda ev: done.set() if ev.finish_reason
                   else None, len(tok))
    eng = Engine(sm, tok, set(), prefill_chunk=5)
    try:
        eng.submit([seq])
        assert done.wait(30)
    finally:
        eng.stop()
    assert seq.out_ids == want


def test_encoder_refused_by_the_causality_probe():
    """A BERT config without architectures passes the config check; its bidirectional attention does not."""
    torch.manual_seed(0)
    bert = BertLMHeadModel(BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=128)).eval()
    with pytest.raises(UserError, match="'bert' \\(BertLMHeadModel\\) is not a causal decoder"):
        make_runner(bert, 2, 32)


def test_vision_only_and_encoder_checkpoints_refused_before_loading(tmp_path):
    from transformers import ViTConfig

    from memfit.hf import load_pretrained

    ViTConfig().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    with pytest.raises(UserError, match="--model: architecture 'vit' .*not a causal decoder"):
        load_pretrained(str(tmp_path), flag="--model")


def test_serve_bert_dir_exits_2_naming_the_architecture(tmp_path):
    BertModel(BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128)).save_pretrained(tmp_path)
    r = subprocess.run([sys.executable, "-m", "serve", "--model", str(tmp_path), "--port", "0"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "architecture 'bert' (BertModel) is not a causal decoder" in r.stderr


def test_health_says_generic_engine(tmp_path, tok):
    from serve.loader import Loaded
    from tests.serve.conftest import make_server

    model = _model("gpt2-layerscale", len(tok))
    loaded = Loaded(model, tok, set(), 128, None)  # no EOS: 4 tokens every time
    s = make_server(str(tmp_path), loaded, max_batch=2, max_seq_len=64)
    try:
        import httpx

        placement = httpx.get(s.url + "/health", timeout=10).json()["placement"]
        assert placement["engine"] == GENERIC and "gpt2" in placement["engine_reason"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "ROMEO.", "max_tokens": 4, "temperature": 0},
                       timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        s.stop()
