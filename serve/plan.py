"""``serve plan MODEL --max-memory ...``: where each module would run and the memory it needs, without loading.

The model is built from its config.json on the meta device (shapes only, no weights read), placed by the
same code ``serve --device-map`` uses (serve.placement), and the KV cache for ``--max-batch`` x
``--max-seq-len`` is added on each layer's execution device. A compress output holds packed integer
modules only compress.load can build, so for those the (small) model is loaded on the CPU and measured.

It also sizes the paged KV cache that ``serve`` uses when it runs the model on one device (serve.kv_config):
``--kv-cache-memory`` (or serve's default share of the memory available now, less the model's parameters) in
blocks of ``--block-size`` tokens, and how many sequences of ``--seq-len`` tokens fit in it at once (with
sliding-window layers a sequence holds fewer blocks than its length: kv_config.KVLayout.seq_blocks).
"""

from __future__ import annotations

import argparse
import json
import sys

from memfit.defaults import max_seq_len
from memfit.errors import UserError
from memfit.modeldir import check_model_dir, read_config
from serve.kv_config import (
    DEFAULT_PREFILL_CHUNK,
    add_kv_args,
    available_memory,
    check_kv_args,
    format_bytes,
    guess_kv_elem_bytes,
    kv_layout,
    num_kv_blocks,
)
from serve.options import add_placement_args, check_placement, placement_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve plan", description="Dry run of serve's placement: prints where each "
                                "module would go and the memory each device needs (parameters + KV cache).")
    p.add_argument("model", help="HF checkpoint dir (safetensors) or compress output")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (prompt + output) for the paged-cache prediction (default: --max-seq-len)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help=f"serve's --prefill-chunk (default {DEFAULT_PREFILL_CHUNK}): a sliding-window layer holds its "
                        "window and one chunk")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_kv_args(p, serving=False)
    add_placement_args(p)
    return p


def kv_prediction(config: dict, args: argparse.Namespace, budget: int | None, msl: int, param_bytes: int) -> dict:
    """The paged KV cache serve would make on one device, and how many ``--seq-len`` sequences fit in it."""
    bs = args.block_size
    lay = kv_layout(config, guess_kv_elem_bytes(args.dtype, args.cpu_kernels), args.kv_cache_dtype, bs, msl)
    avail = None if budget is not None else max(0, available_memory("cpu") - param_bytes)
    n, how = num_kv_blocks(budget, lay, args.max_batch, msl, args.prefill_chunk, avail)
    seq_len = args.seq_len or msl
    fit = n // lay.seq_blocks(seq_len, args.prefill_chunk)
    groups = lay.groups
    # static slots hold --max-seq-len positions in every layer: len(groups) blocks' worth per block of positions
    return {"bytes": n * lay.bytes_per_block, "how": how, "block_size": bs, "blocks": n,
            "bytes_per_block": lay.bytes_per_block, "tokens": n * bs // len(groups),  # positions in every layer
            "kv_groups": len(groups), "layers_per_group": groups.size,
            "sliding_windows": groups.sliding_windows, "seq_len": seq_len, "sequences_fit": fit,
            "running_at_once": min(fit, args.max_batch), "static_slots_same_bytes": n * bs // (msl * len(groups))}


def format_kv(kv: dict, max_batch: int, msl: int) -> str:
    groups = (f"{kv['kv_groups']} KV groups of {kv['layers_per_group']} layers (sliding windows "
              f"{kv['sliding_windows']}: their blocks behind the window are freed)" if kv["sliding_windows"] else
              "every layer")
    return (f"paged KV cache (serve on one device): {format_bytes(kv['bytes'])} = {kv['blocks']} blocks of "
            f"{kv['block_size']} tokens in {groups} ({format_bytes(kv['bytes_per_block'])} each, {kv['tokens']} "
            f"tokens; {kv['how']})\n  sequences of {kv['seq_len']} tokens that fit: {kv['sequences_fit']} (running "
            f"at once: {kv['running_at_once']}, --max-batch {max_batch}); static slots of --max-seq-len {msl} in the "
            f"same bytes: {kv['static_slots_same_bytes']}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = read_config(check_model_dir(args.model), "MODEL")
        if args.max_batch < 1:
            raise UserError("--max-batch must be >= 1")
        if args.prefill_chunk < 1:
            raise UserError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
        msl = max_seq_len(config, args.max_seq_len)
        budget = check_kv_args(args)
        if args.seq_len is not None and not 1 <= args.seq_len <= msl:
            raise UserError(f"--seq-len must be in 1..--max-seq-len ({msl}), got {args.seq_len}")
        check_placement(args)
        if args.device_map is None and args.max_memory is None:
            args.device_map = "auto"
        placement = placement_from_args(args)
        import torch

        from serve.loader import resolve_dtype
        from serve.placement import DTYPES_BY_NAME, compute_plan, format_plan, meta_model

        dtype = DTYPES_BY_NAME.get(args.dtype) or resolve_dtype(args.dtype, config)
        if "quantization_config" in config:
            import compress

            model, how = compress.load(args.model, device="cpu"), "loaded on CPU and measured (compress output)"
        else:
            model, how = meta_model(args.model, dtype), "meta device, no weights read"
        plan = compute_plan(model, placement.device_map, placement.max_memory, args.max_batch, msl, dtype,
                            prefetch=placement.prefetch)
        kv = kv_prediction(config, args, budget, msl, sum(m.param_bytes for m in plan.modules))
    except UserError as e:
        print(f"serve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, "dtype": str(dtype).removeprefix("torch."), "max_batch": args.max_batch,
                          "max_seq_len": msl, **plan.summary(), "kv": kv,
                          "modules": [vars(x) | {"device": str(x.device)} for x in plan.modules]}, indent=1))
    else:
        print(f"plan for {args.model} ({how}); dtype {str(dtype).removeprefix('torch.')}, KV cache for "
              f"--max-batch {args.max_batch} x --max-seq-len {msl}, devices visible: "
              f"{torch.cuda.device_count()} GPU + cpu + disk")
        print(format_plan(plan))
        print(format_kv(kv, args.max_batch, msl))
    return 0
