"""Tokenizer metadata of a GGUF export, built from an HF dir's tokenizer.json as convert_hf_to_gguf.py does.

Two vocabularies llama.cpp runs natively:
- SentencePiece-like BPE (byte_fallback, the `▁` space marker; Gemma, Llama 2): tokenizer.ggml.model "llama" with
  tokens, scores and token types. No tokenizer.model is needed: a SentencePiece BPE vocabulary is ordered by
  score, so normal pieces get score -rank (the merge order llama.cpp's SPM tokenizer follows); the pieces placed
  before the byte pieces <0x00>..<0xFF> are SentencePiece user-defined ones (Gemma's runs of spaces), stored,
  like convert_hf_to_gguf.py does, with `▁` turned back into spaces.
- Byte-level BPE (GPT-2 style): "gpt2" with tokens, token types, merges and tokenizer.ggml.pre, the
  pre-tokenizer regex llama.cpp implements ("gpt-2", "llama-bpe", "qwen2"), read off tokenizer.json's regex.
Special token ids, add_bos/add_eos and the chat template come from gguf.SpecialVocab.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import gguf

from memfit.errors import UserError

TT = gguf.TokenType
BYTE_RE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# the regexes of tokenizer.json pre-tokenizers that llama.cpp implements (llama-vocab.cpp quotes them)
_BPE_RE = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|%s| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLIT_REGEXES = {_BPE_RE % r"\p{N}{1,3}": "llama-bpe", _BPE_RE % r"\p{N}": "qwen2"}


def _looks_special(tok: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special: added tokens marked non-special that are control ones."""
    return (tok in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (tok.startswith("<|") and tok.endswith("|>"))
            or (tok.startswith("<｜") and tok.endswith("｜>")) or (tok.startswith("<unused") and tok.endswith(">")))


def _parts(node: dict[str, Any] | None) -> list[dict[str, Any]]:
    node = node or {}
    if node.get("type") == "Sequence":
        return list(node.get("pretokenizers") or node.get("normalizers") or node.get("decoders") or [])
    return [node] if node else []


def _bpe_pre(tj: dict[str, Any]) -> str:
    parts = _parts(tj.get("pre_tokenizer"))
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        name = SPLIT_REGEXES.get((parts[0].get("pattern") or {}).get("Regex", ""))
        if name:
            return name
    raise UserError(f"tokenizer.json: byte-level BPE pre-tokenizer {kinds} is not one llama.cpp implements "
                    "(supported: GPT-2 ByteLevel, the Llama 3 and Qwen2 split regexes)")


def _space_prefix(tj: dict[str, Any]) -> bool:
    """Whether the tokenizer prepends `▁` to the text (SentencePiece add_dummy_prefix)."""
    if any(n.get("type") == "Prepend" and n.get("prepend") == "▁" for n in _parts(tj.get("normalizer"))):
        return True
    return any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
               and p.get("add_prefix_space", True) for p in _parts(tj.get("pre_tokenizer")))


def add_vocab(w: gguf.GGUFWriter, model_dir: Path, n_vocab: int) -> str:
    """Write the tokenizer.* keys for n_vocab ids (the embedding's rows); returns "llama" or "gpt2 (<pre>)"."""
    f = model_dir / "tokenizer.json"
    try:
        tj = json.loads(f.read_text(encoding="utf-8"))
        model = tj["model"]
        vocab: dict[str, int] = dict(model["vocab"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{model_dir}: GGUF export needs a readable tokenizer.json ({type(e).__name__}: {e})") from None
    added = {int(a["id"]): a for a in tj.get("added_tokens") or []}
    id2tok = {i: t for t, i in vocab.items()} | {i: a["content"] for i, a in added.items()}
    if id2tok and max(id2tok) >= n_vocab:
        raise UserError(f"{f}: token id {max(id2tok)} is past the model's vocab_size {n_vocab}")
    spm = (model.get("type") == "BPE" and model.get("byte_fallback")
           and any(d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == "▁"
                   for d in _parts(tj.get("decoder"))))
    if not spm and (model.get("type") != "BPE" or not any(p.get("type") == "ByteLevel"
                                                          for p in _parts(tj.get("pre_tokenizer")))):
        raise UserError(f"{f}: {model.get('type')} tokenizer is not supported by the GGUF export (supported: "
                        "SentencePiece-style BPE with byte fallback, byte-level BPE)")
    byte_ids = [i for t, i in vocab.items() if BYTE_RE.fullmatch(t)]
    first_byte = min(byte_ids) if spm and byte_ids else -1
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    rank = 0
    for i in range(n_vocab):
        tok, score, typ = id2tok.get(i), -1000.0, TT.USER_DEFINED
        if tok is None:
            tok, typ = f"[PAD{i}]", TT.UNUSED
        elif i in added and (added[i].get("special") or _looks_special(tok)):
            typ = TT.CONTROL
        elif i in added or i < first_byte:
            tok = tok.replace("▁", " ") if spm else tok  # user-defined pieces match the raw text
        elif spm and BYTE_RE.fullmatch(tok):
            score, typ = 0.0, TT.BYTE
        else:
            score, typ, rank = -float(rank), TT.NORMAL, rank + 1
        tokens.append(tok)
        scores.append(score)
        types.append(typ)
    w.add_tokenizer_model("llama" if spm else "gpt2")
    w.add_tokenizer_pre("default" if spm else _bpe_pre(tj))
    w.add_token_list(tokens)
    if spm:
        w.add_token_scores(scores)
    w.add_token_types(types)
    if spm:
        w.add_add_space_prefix(_space_prefix(tj))
    log = logging.getLogger("gguf.vocab")
    level = log.level
    log.setLevel(logging.ERROR)  # not its warning about TemplateProcessing's pair template
    try:
        special = gguf.SpecialVocab(model_dir, load_merges=not spm, n_vocab=n_vocab)
    finally:
        log.setLevel(level)
    if not spm and not special.merges:
        raise UserError(f"{f}: byte-level BPE without merges")
    for kind in ("bos", "eos"):  # absent: HF adds none, and llama.cpp must not either
        special.add_special_token.setdefault(kind, False)
    special.add_to_gguf(w, quiet=True)
    return "llama (SentencePiece-style)" if spm else f"gpt2 ({_bpe_pre(tj)})"
