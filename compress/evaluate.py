"""`compress eval` and `compress info`: perplexity, size on disk, decode speed; a model dir's summary."""

from __future__ import annotations

import inspect
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.store import WeightSource
from memfit.modeldir import dir_bytes, read_config

EVAL_SEQLEN = 512  # tokens per perplexity window (compress eval --seqlen)


def windows(tokens: torch.Tensor, seqlen: int, bos: int | None = None) -> list[torch.Tensor]:
    """Non-overlapping windows of seqlen tokens ((k, seqlen), then the tail (1, r) when r >= 2); with bos
    (calib.bos_id), each window is BOS + seqlen - 1 text tokens, as the model saw text in training."""
    body = seqlen - (bos is not None)
    n = (tokens.numel() // body) * body
    out = [tokens[:n].view(-1, body)] if n else []
    if tokens.numel() - n >= 2:
        out.append(tokens[n:].view(1, -1))
    if bos is not None:
        out = [torch.cat([torch.full((w.shape[0], 1), bos, dtype=w.dtype), w], 1) for w in out]
    return out


@torch.no_grad()
def perplexity(model: nn.Module, tokens: torch.Tensor, seqlen: int = EVAL_SEQLEN, batch: int = 8,
               bos: int | None = None) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of seqlen tokens (see windows for bos)."""
    dev = next(model.parameters(), torch.empty(0)).device
    if any(True for _ in model.buffers()):
        dev = next(model.buffers()).device
    nll, count = 0.0, 0
    for w in windows(tokens, seqlen, bos):
        for i in range(0, w.shape[0], batch):
            x = w[i : i + batch].to(dev)
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     x[:, 1:].reshape(-1), reduction="sum")
            nll += loss.item()
            count += x[:, 1:].numel()
    return math.exp(nll / count)


@torch.no_grad()
def kl_reference(fp: nn.Module, tokens: torch.Tensor, seqlen: int,
                 bos: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(window batch, fp log-probs) pairs over the whole windows of seqlen tokens, for kl_against."""
    whole = [w for w in windows(tokens, seqlen, bos) if w.shape[1] == seqlen]
    return [(w, torch.log_softmax(fp(input_ids=w).logits.float(), -1)) for ws in whole for w in ws.split(8)]


@torch.no_grad()
def kl_against(m: nn.Module, ref: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Mean per-token KL(fp || m) and top-1 agreement over kl_reference's windows."""
    kl, agree, count = 0.0, 0, 0
    for w, lp in ref:
        lq = torch.log_softmax(m(input_ids=w).logits.float(), -1)
        kl += (lp.exp() * (lp - lq)).sum().item()
        agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        count += lp.shape[0] * lp.shape[1]
    return kl / count, agree / count


def cpu_model() -> str:
    """The CPU's model name and count ("AMD EPYC, 2 CPUs"): this host boots on different CPUs, so every
    benchmark result records which one it ran on."""
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} CPUs"


def host_isa() -> str:
    """The widest x86 vector extensions of this CPU ("avx512_bf16", "avx512", "avx2" or "other"): kernel speeds,
    bitsandbytes' CPU path and bf16 all change with them, and the same VM type can boot on either."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return "other"
    for name, need in (("avx512_bf16", {"avx512f", "avx512_bf16"}), ("avx512", {"avx512f"}), ("avx2", {"avx2"})):
        if need <= flags:
            return name
    return "other"


def decode_speed(model: nn.Module, new_tokens: int = 32, prompt_len: int = 16,
                 clock: Callable[[], float] = time.perf_counter, engine: str = "hf") -> float:
    """Greedy batch-1 decode tokens/s with a KV cache: 1 / median per-token latency after 2 warm-up steps.

    engine="hf": the model's own forward with transformers' dynamic cache (what `generate` runs);
    engine="serve": the serve engine's packed forward over a static slot cache (memfit.runtime SlotModel, what
    `serve` runs: fused QKV / gate-up int4 kernels, oneDNN fp32 Linears where timed faster, no per-step cache
    reallocation). It replaces the model's fp32 Linears in place (memfit.runtime.dense): measure "hf" on another copy.
    For an architecture SlotModel lacks, "serve" measures serve's generic engine (HF's forward and cache, one
    sequence per call: about what "hf" measures, which `compress eval --decode-engine auto` picks for it).
    The median (not the mean) because the machine may be shared: a descheduled step says little about the model.
    clock=time.process_time counts this process's CPU time only (with 1 torch thread, time spent descheduled by
    other jobs on a shared machine drops out; memory-bandwidth contention does not).
    """
    if engine not in ("hf", "serve"):
        raise ValueError(f"engine must be 'hf' or 'serve', not {engine!r}")
    vocab = model.config.vocab_size
    dev = next(model.parameters()).device
    ids = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(dev)
    if engine == "serve":
        return _slot_decode_speed(model, ids[0], new_tokens, clock)
    # transformers >= 5.2x names the KV cache argument `cache` (past_key_values is deprecated)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for i in range(new_tokens + 2):
            t0 = clock()
            out = model(input_ids=nxt, use_cache=True, **{key: out[key]})
            nxt = out.logits[:, -1:].argmax(-1)
            if i >= 2:
                times.append(clock() - t0)
    return 1.0 / statistics.median(times)


def _slot_decode_speed(model: nn.Module, ids: torch.Tensor, new_tokens: int, clock: Callable[[], float]) -> float:
    # serve builds on compress; imported only when asked for. make_runner: what `serve` runs for this model (the
    # packed SlotModel, or for an architecture it lacks HF's forward and cache, memfit.runtime.generic)
    from memfit.runtime.generic import make_runner
    from memfit.runtime.slot_model import Segment

    sm = make_runner(model, max_batch=1, max_seq_len=len(ids) + new_tokens + 2, dense_kernel="auto",
                     cpu_kernels="auto")
    nxt = sm.forward(ids, [Segment(0, 0, len(ids))]).argmax(-1)
    pos, times = len(ids), []
    for i in range(new_tokens + 2):
        t0 = clock()
        nxt = sm.forward(nxt, [Segment(0, pos, 1)]).argmax(-1)
        pos += 1
        if i >= 2:
            times.append(clock() - t0)
    return 1.0 / statistics.median(times)


def describe(path: str | Path) -> dict[str, Any]:
    """Config and on-disk summary of a model dir (no weights loaded)."""
    path = Path(path)
    src = WeightSource(path)
    cfg = read_config(path)
    qc = cfg.get("quantization_config") or {}
    kinds: dict[str, int] = {}
    params = 0
    for k in src.keys():
        f = src.key_file[k]
        sl = src.handles[f].get_slice(k)
        dtype = sl.get_dtype()
        kinds[dtype] = kinds.get(dtype, 0) + 1
        if not k.endswith(("weight_shape", "weight_scale", "weight_zero_point")):
            params += math.prod(sl.get_shape())
    memfit = qc.get("memfit", {})
    return {
        "path": str(path), "model_type": cfg.get("model_type"), "layers": cfg.get("num_hidden_layers"),
        "hidden": cfg.get("hidden_size"), "vocab": cfg.get("vocab_size"),
        "quant_method": qc.get("quant_method", "none"), "method": memfit.get("method", "-"),
        "bits": memfit.get("bits", "-"), "group_size": memfit.get("group_size", "-"),
        "symmetric": memfit.get("symmetric", "-"), "skipped": memfit.get("skipped", []),
        "group_size_fallbacks": memfit.get("group_size_fallbacks", {}),
        "tensors": len(src.keys()), "dtypes": kinds, "stored_elements": params,
        "weights_bytes": dir_bytes(path), "dir_bytes": dir_bytes(path, "*"),
    }


def format_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    width = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "| " + " | ".join(c.ljust(w) for c, w in zip(cols, width, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in width) + "|"
    body = ["| " + " | ".join(v.ljust(w) for v, w in zip(row, width, strict=True)) + " |" for row in cells]
    return "\n".join([line, sep, *body])
