"""The generic engine: any ``AutoModelForCausalLM`` decoder through its own HF forward and HF's own KV cache.

SlotModel (memfit.runtime.slot_model) runs the architectures it knows (``SUPPORTED_TYPES``) as one packed
forward over a static slot cache. Every other causal decoder (GPT-2, GPT-NeoX, Phi-3, Gemma 2, ...) runs here
instead of being refused: :class:`HFCacheModel` has SlotModel's interface (``forward(input_ids, segments)`` and
the attributes serve and compress read), keeps one transformers ``DynamicCache`` per slot, built from the
model's config so sliding-window and hybrid layers are HF's business, and calls the model once per segment
(one sequence per call: slower than the packed engine, which /health says). :func:`make_runner` picks the
engine; both refuse what is not a causal decoder, naming the architecture.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.errors import UserError
from memfit.hf import not_causal_decoder
from memfit.runtime import slot_model
from memfit.runtime.modules import exec_device
from memfit.runtime.offload import _offload_hooks
from memfit.runtime.slot_model import Segment, SlotModel

log = logging.getLogger("memfit.runtime.generic")

PACKED = "packed"
GENERIC = "hf-generic (slower: HF modules and cache, one sequence per call)"


@dataclass
class NoPrefetch:
    """SlotModel's ``prefetch`` as the generic engine has it: accelerate's own hooks load offloaded layers inside
    the HF forward (no loading ahead); ``offloaded`` still lists those layers for /health."""

    offloaded: list[int] = field(default_factory=list)
    enabled: bool = False

    @property
    def active(self) -> bool:
        return False

    def begin(self, i: int) -> None:
        pass

    def end(self, i: int) -> None:
        pass

    def reset(self) -> None:
        pass


def _text_config(cfg: Any) -> Any:
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks: the longest ModuleList of ``num_hidden_layers`` modules (``model.layers``,
    ``transformer.h``, ``gpt_neox.layers``, ...); [] where none matches."""
    n = getattr(_text_config(model.config), "num_hidden_layers", None)
    best: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(best) and (n is None or len(m) == n):
            best = list(m)
    return best


class HFCacheModel:
    """SlotModel's interface over the HF model's own forward, one ``DynamicCache`` per slot.

    ``cache_dtype``, ``dense_kernel``, ``cpu_kernels``, ``bf16_weights``, ``num_blocks`` and ``block_size`` are
    accepted for the same call signature and ignored (its caches are never paged: ``paged`` is False):
    HF's cache holds the model's dtype and its modules run as they are. ``prefetch`` is ignored too (offloaded
    layers load inside their own forward, through accelerate's hooks)."""

    engine = GENERIC
    paged = False

    def __init__(self, hf_model: torch.nn.Module, max_batch: int, max_seq_len: int,
                 cache_dtype: torch.dtype | None = None, prefetch: bool = False, dense_kernel: str = "off",
                 cpu_kernels: str = "off", bf16_weights: bool = False, num_blocks: int | None = None,
                 block_size: int | None = None, reason: str = ""):
        cfg = hf_model.config
        problem = not_causal_decoder(cfg)
        if problem:
            raise UserError(f"model: {problem}")
        self.hf = hf_model.eval()
        self.config = cfg
        self.reason = reason  # why the packed engine does not run this model (shown by /health)
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.vocab_size = int(getattr(cfg, "vocab_size", None) or _text_config(cfg).vocab_size)
        layers = _decoder_layers(hf_model)
        self.layer_devices = [exec_device(ly) for ly in layers] or [exec_device(hf_model)]
        emb = hf_model.get_input_embeddings() if hasattr(hf_model, "get_input_embeddings") else None
        self.device = exec_device(emb) if emb is not None else self.layer_devices[0]
        # SlotModel-only parts, neutral: nothing packed, no memfit kernels, no C++ layer loop
        self.dense_packed, self.ops, self.int4_kernel, self.stack = 0, None, 0, None
        self.prefetch = NoPrefetch([i for i, ly in enumerate(layers) if _offload_hooks(ly)])
        # keyword names of this transformers version (>= 5.2x: `cache`, no cache_position; 4.x: the others)
        params = inspect.signature(hf_model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._position_ids = "position_ids" in params  # absent in ALiBi models (bloom, mpt): positions unused
        self._cache_position = "cache_position" in params
        self._logits_to_keep = "logits_to_keep" in params  # the LM head on the last token only
        self.caches: list[object | None] = [None] * max_batch
        self.lengths = [0] * max_batch  # positions held by each slot's cache

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)  # sliding / hybrid layer types from the config, as generate() does

    @property
    def cache_bytes(self) -> int:
        return sum(self.cache_bytes_per_device().values())

    def cache_bytes_per_device(self) -> dict[str, int]:
        """The bytes the slots' caches hold *now* (HF's cache grows with each sequence, up to max_seq_len
        positions, or a sliding window's, per layer): not an upper bound as SlotModel's preallocated cache."""
        out: dict[str, int] = {}
        for c in self.caches:
            for layer in getattr(c, "layers", None) or []:
                for t in vars(layer).values():
                    if isinstance(t, torch.Tensor):
                        out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
        return out

    def clear_slot(self, slot: int) -> None:
        """Release the slot's cache (a later segment at position 0 makes a new one)."""
        self.caches[slot], self.lengths[slot] = None, 0

    def _check(self, input_ids: torch.Tensor, segments: list[Segment]) -> None:
        """Refuse the whole step before anything runs: positions past max_seq_len, unknown slots, and segments
        that do not continue their slot's cache (a new sequence starts at 0)."""
        if int(input_ids.shape[0]) != sum(s.length for s in segments):
            raise ValueError("input_ids and segments disagree on the number of tokens")
        held = list(self.lengths)
        for s in segments:
            if not 0 <= s.slot < self.max_batch:
                raise ValueError(f"slot {s.slot} outside 0..{self.max_batch - 1}")
            if s.start + s.length > self.max_seq_len:
                raise ValueError("position beyond max_seq_len")
            if s.start and s.start != held[s.slot]:
                raise ValueError(f"slot {s.slot}: segment starts at {s.start}, its cache holds {held[s.slot]} "
                                 "positions")
            held[s.slot] = s.start + s.length

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Run ``input_ids`` (1-D, the segments' tokens concatenated in order) and return the logits (float32 on
        CPU, ``[num segments with want_logits, vocab]``) of each wanting segment's last token."""
        self._check(input_ids, segments)
        rows: list[torch.Tensor] = []
        o = 0
        try:
            for s in segments:
                ids = input_ids[o:o + s.length]
                o += s.length
                if s.start == 0:  # a new sequence took the slot
                    self.caches[s.slot] = self._new_cache()
                logits = self._run(ids, s)
                self.lengths[s.slot] = s.start + s.length
                if s.want_logits:
                    rows.append(logits.float().cpu())
        except BaseException:
            # a half-run step may have appended to some layers' caches only: those slots hold nothing usable
            for s in segments:
                self.clear_slot(s.slot)
            raise
        if not rows:
            return torch.empty(0, self.vocab_size)
        return torch.stack(rows)

    def _run(self, ids: torch.Tensor, s: Segment) -> torch.Tensor:
        """One segment through the HF forward on its slot's cache; the logits of its last token."""
        cache = self.caches[s.slot]
        kw: dict = {self._cache_kw: cache, "use_cache": True}
        pos = torch.arange(s.start, s.start + s.length, device=self.device)
        if self._position_ids:
            kw["position_ids"] = pos[None]
        if self._cache_position:
            kw["cache_position"] = pos
        if self._logits_to_keep:
            kw["logits_to_keep"] = 1
        out = self.hf(input_ids=ids[None].to(self.device), **kw)
        new = getattr(out, self._cache_kw, None)
        if new is not None:  # the same object in transformers 5; older models may return a new one
            self.caches[s.slot] = new
        return out.logits[0, -1]


@torch.inference_mode()
def causality_problem(hf_model: torch.nn.Module) -> str | None:
    """Why the model is not causal, or None: the first token's logits must not change with later tokens.
    Catches encoders that transformers also maps to a causal head (BertLMHeadModel without ``is_decoder``
    attends both ways) where the config did not tell (memfit.hf.not_causal_decoder)."""
    cfg = hf_model.config
    v = int(getattr(cfg, "vocab_size", None) or _text_config(cfg).vocab_size)
    emb = hf_model.get_input_embeddings() if hasattr(hf_model, "get_input_embeddings") else None
    dev = exec_device(emb) if emb is not None else exec_device(hf_model)
    a = torch.tensor([[1, 2, 3, 4]], device=dev) % v
    b = torch.tensor([[1, 5, 6, 7]], device=dev) % v
    la = hf_model(input_ids=a, use_cache=False).logits[0, 0].float()
    lb = hf_model(input_ids=b, use_cache=False).logits[0, 0].float()
    if torch.allclose(la, lb, rtol=1e-3, atol=1e-3 * float(la.abs().max().clamp_min(1.0))):
        return None
    mt = getattr(cfg, "model_type", None)
    return (f"architecture {mt!r} ({type(hf_model).__name__}) is not a causal decoder: its first token's logits "
            "change with later tokens (an encoder?); memfit runs AutoModelForCausalLM models")


def supports(config: Any) -> bool:
    """Whether the packed engine (SlotModel) knows the architecture."""
    return getattr(config, "model_type", None) in slot_model.SUPPORTED_TYPES


def make_runner(hf_model: torch.nn.Module, max_batch: int, max_seq_len: int, generic_ok: bool = True,
                **kwargs: Any) -> SlotModel | HFCacheModel:
    """The engine for ``hf_model``: SlotModel where it supports the architecture, else HFCacheModel.
    ``kwargs`` are SlotModel's (cache_dtype, prefetch, dense_kernel, cpu_kernels, bf16_weights, num_blocks,
    block_size). ``generic_ok=False``
    (tensor parallel, which only SlotModel does) refuses models that would run on the generic engine."""
    cfg = hf_model.config
    mt = getattr(cfg, "model_type", None)
    problem = not_causal_decoder(cfg)
    if problem:
        raise UserError(f"model: {problem}")
    if supports(cfg):
        try:
            return SlotModel(hf_model, max_batch, max_seq_len, **kwargs)
        except slot_model.UnsupportedModel as e:
            # a feature of a known architecture the packed path lacks (refused before the model is touched):
            # HF's forward runs it; SlotModel's other errors are the user's
            reason = str(e).removeprefix("model: ")
    else:
        reason = f"architecture {mt!r} is not one the packed engine runs " \
                 f"({', '.join(sorted(slot_model.SUPPORTED_TYPES))})"
    if not generic_ok:
        raise UserError(f"--tp: {reason}, and the generic engine that runs it has no tensor parallelism; "
                        "serve it without --tp")
    bad = causality_problem(hf_model)
    if bad:
        raise UserError(f"model: {bad}")
    log.info("engine: %s, because %s", GENERIC, reason)
    return HFCacheModel(hf_model, max_batch, max_seq_len, reason=reason, **kwargs)
