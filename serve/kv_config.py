"""How big the paged KV cache is: the ``--kv-cache*`` / ``--block-size`` flags, sizes like ``2GiB``, and the
budget -> block count arithmetic that ``serve`` (at load) and ``serve plan`` (without loading) share.

One block holds ``block_size`` token positions of K and V in every layer of one KV group (memfit.runtime.kv_groups:
every layer, for a model without sliding-window layers), so ``bytes_per_block = 2 x group layers x kv_heads x
head_dim x block_size x element bytes`` and a budget of B bytes is ``B // bytes_per_block`` blocks
(``--kv-cache-dtype int8``: one byte an element plus an fp32 scale per token and KV head). A sequence holds a
block per group for each ``block_size`` of its positions, but a sliding group only those inside its window.
The default budget is ``DEFAULT_KV_FRACTION`` of the memory available on the cache's device once the model is
loaded, capped at what static slots would take (``--max-batch`` sequences of ``--max-seq-len``) and never below
one ``--max-seq-len`` sequence. Nothing here imports torch at module level: bad flags fail fast.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from memfit.errors import UserError
from memfit.runtime.kv_groups import KVGroups, config_value, group_layers, layer_windows
from memfit.sizes import format_bytes, parse_size  # noqa: F401  (format_bytes: used by serve's reports)

log = logging.getLogger("serve.kv")

DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_FRACTION = 0.25  # of the available memory on the device, when --kv-cache-memory is not given
MAX_BLOCK_SIZE = 4096
KV_CACHE_DTYPES = ("auto", "int8")
KV_SCALE_BYTES = 4  # int8 KV: the fp32 scale of one (token, KV head) row of K or V
DEFAULT_PREFILL_CHUNK = 256  # serve's --prefill-chunk: prompt tokens per step (a sliding group holds its window + one)


def add_kv_args(p: argparse.ArgumentParser, serving: bool = True) -> None:
    """``--kv-cache-memory`` and ``--block-size`` (serve and serve plan); ``--kv-cache``, ``--no-prefix-cache``
    (serve only)."""
    if serving:
        p.add_argument("--kv-cache", choices=["paged", "static"], default="paged",
                       help="paged (default): KV memory in blocks of --block-size tokens that sequences take as "
                            "they grow, sized by --kv-cache-memory, with prefix caching; static: every one of "
                            "--max-batch slots holds --max-seq-len positions (the engine before paging). Models run "
                            "placed (--device-map), tensor-parallel or by the generic engine are always static")
    p.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                   help=f"paged KV cache size, e.g. 2GiB, 512MiB (or bytes); default: "
                        f"{DEFAULT_KV_FRACTION * 100:.0f}%% of the memory available after loading, at most --max-batch "
                        "x --max-seq-len positions and at least one --max-seq-len sequence")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help=f"token positions per KV block (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default="auto",
                   help="auto (default): K and V in the engine's activation dtype (fp32; fp16/bf16 on torch ops); "
                        "int8: one byte an element and a scale per token and KV head, dequantized inside attention "
                        "(0.27x of fp32's bytes at head_dim 64, 0.25x at 256: ~3.8x the tokens in the same memory; the "
                        "packed engine only)")
    if serving:
        p.add_argument("--no-prefix-cache", action="store_true",
                       help="do not reuse the KV blocks of identical prompt prefixes (automatic prefix caching)")


def check_kv_args(args: argparse.Namespace) -> int | None:
    """Validate the KV flags; returns ``--kv-cache-memory`` in bytes (None: the default)."""
    if not 1 <= args.block_size <= MAX_BLOCK_SIZE:
        raise UserError(f"--block-size must be in 1..{MAX_BLOCK_SIZE}, got {args.block_size}")
    if args.kv_cache_memory is None:
        return None
    budget = parse_size(args.kv_cache_memory, "--kv-cache-memory")
    if getattr(args, "kv_cache", "paged") == "static":
        raise UserError("--kv-cache-memory sizes the paged cache; --kv-cache static takes --max-batch x "
                        "--max-seq-len positions")
    return budget


def kv_bytes_per_token(config, elem_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """K + V bytes of one token position over all layers (``config``: config.json's dict or an HF config);
    ``kv_cache_dtype`` int8: ``elem_bytes`` is ignored, a row is head_dim bytes and its scale."""
    return int(config_value(config, "num_hidden_layers")) * _layer_bytes_per_token(config, elem_bytes, kv_cache_dtype)


def _layer_bytes_per_token(config, elem_bytes: int, kv_cache_dtype: str) -> int:
    heads = config_value(config, "num_attention_heads")
    kv = config_value(config, "num_key_value_heads") or heads
    head_dim = config_value(config, "head_dim") or config_value(config, "hidden_size") // heads
    row = head_dim + KV_SCALE_BYTES if kv_cache_dtype == "int8" else head_dim * elem_bytes
    return 2 * kv * row


@dataclass(frozen=True)
class KVLayout:
    """The paged cache's shape for a model: its KV groups, the block size and the bytes of one block."""

    groups: KVGroups
    block_size: int
    bytes_per_block: int

    def seq_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of ``num_tokens`` positions holds at once, prefilled ``chunk`` at a time."""
        return self.groups.blocks_held(num_tokens, self.block_size, chunk)


def kv_layout(config, elem_bytes: int, kv_cache_dtype: str, block_size: int, max_seq_len: int) -> KVLayout:
    """The paged cache serve makes for ``config`` (config.json's dict or the loaded model's HF config)."""
    groups = group_layers(layer_windows(config, max_seq_len))
    return KVLayout(groups, block_size,
                    _layer_bytes_per_token(config, elem_bytes, kv_cache_dtype) * groups.size * block_size)


def kv_torch_dtype(kv_cache_dtype: str):
    """``--kv-cache-dtype`` as SlotModel's ``cache_dtype``: torch.int8, or None (the engine's own choice)."""
    if kv_cache_dtype == "int8":
        import torch

        return torch.int8
    return None


def guess_kv_elem_bytes(dtype: str, cpu_kernels: str) -> int:
    """Before loading: the KV cache's element size for ``--dtype`` (fp32 but for fp16, and bf16 on torch ops;
    bf16 on memfit's kernels keeps an fp32 cache). ``model_kv_elem_bytes`` gives the loaded model's."""
    return 2 if dtype == "fp16" or (dtype == "bf16" and cpu_kernels == "off") else 4


def model_kv_elem_bytes(model, bf16_weights: bool) -> int:
    """The loaded model's KV element size, as the engine picks its cache dtype (SlotModel: fp32 with bf16
    weights, else the input embedding's dtype, else the first floating parameter's)."""
    if bf16_weights:
        return 4
    w = getattr(model.get_input_embeddings(), "weight", None)
    if w is not None and w.dtype.is_floating_point:
        return w.element_size()
    return next((p.element_size() for p in model.parameters() if p.dtype.is_floating_point), 4)


def available_memory(device) -> int:
    """Bytes free for the KV cache on ``device`` (a torch.device or name): CUDA's free memory, else the host's
    available memory."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # accelerate depends on psutil; this is a fallback for bare installs
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_kv_blocks(budget: int | None, layout: KVLayout, max_batch: int, max_seq_len: int, chunk: int,
                  available: int | None = None) -> tuple[int, str]:
    """Blocks for a budget, and how the size was chosen (for the start-up line). ``budget`` None: the default
    (``available`` needed). Refuses, naming ``--kv-cache-memory``, a budget below one block or below one
    ``--max-seq-len`` sequence (prefilled ``chunk`` tokens a step)."""
    bpb, block_size = layout.bytes_per_block, layout.block_size
    per_seq = layout.seq_blocks(max_seq_len, chunk)
    if budget is None:
        cap = max_batch * per_seq
        n = max(per_seq, min(cap, int(DEFAULT_KV_FRACTION * (available or 0)) // bpb))
        how = (f"default: {DEFAULT_KV_FRACTION:.0%} of {format_bytes(available or 0)} available, at most --max-batch "
               f"x --max-seq-len, at least one --max-seq-len sequence")
        return n, how
    depth = f"{layout.groups.size} layers" if len(layout.groups) > 1 else "every layer"
    if budget < bpb:
        raise UserError(f"--kv-cache-memory {format_bytes(budget)} is smaller than one KV block ({block_size} tokens "
                        f"in {depth}: {format_bytes(bpb)}); give at least {format_bytes(per_seq * bpb)} (one "
                        f"--max-seq-len {max_seq_len} sequence)")
    n = budget // bpb
    if n < per_seq:
        raise UserError(f"--kv-cache-memory {format_bytes(budget)} holds {n} blocks of {block_size} tokens, but one "
                        f"--max-seq-len {max_seq_len} sequence needs {per_seq}: give at least "
                        f"{format_bytes(per_seq * bpb)} ({per_seq * bpb} bytes) or lower --max-seq-len")
    return n, f"--kv-cache-memory {format_bytes(budget)}"


def paged_cache_size(config, elem_bytes: int, kv_cache_dtype: str, budget: int | None, block_size: int,
                     max_batch: int, max_seq_len: int, chunk: int, device) -> dict:
    """make_runner's paged-cache arguments for a loaded model (num_blocks, block_size, and the bytes_per_block
    they were sized with); logs the size chosen. ``budget`` None: the default share of ``device``'s memory."""
    lay = kv_layout(config, elem_bytes, kv_cache_dtype, block_size, max_seq_len)
    bpb = lay.bytes_per_block
    avail = available_memory(device) if budget is None else None
    n, how = num_kv_blocks(budget, lay, max_batch, max_seq_len, chunk, avail)
    groups = lay.groups
    shape = (f"{len(groups)} groups of {groups.size} layers, windows {sorted({w or 0 for w in groups.windows})}"
             if len(groups) > 1 else "one group")
    log.info("KV cache: %s %s on %s = %d blocks of %d tokens (%s each; %s; %s)", format_bytes(n * bpb),
             "int8" if kv_cache_dtype == "int8" else f"{elem_bytes}-byte", device, n, block_size, format_bytes(bpb),
             shape, how)
    return {"num_blocks": n, "block_size": block_size, "bytes_per_block": bpb}


def check_kv_dtype(runner, kv_cache_dtype: str) -> None:
    """``--kv-cache-dtype int8`` on an engine that cannot hold it (the generic engine, HF's own cache): refused
    rather than silently served at full size."""
    if kv_cache_dtype == "int8" and not getattr(runner, "kv_int8", False):
        raise UserError(f"--kv-cache-dtype int8 runs on the packed engine; this model runs on the "
                        f"{getattr(runner, 'engine', 'generic')} engine ({getattr(runner, 'reason', '')}) with HF's "
                        "own cache: drop --kv-cache-dtype")
