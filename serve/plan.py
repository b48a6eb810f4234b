"""``serve plan MODEL --max-memory ...``: where each module would run and the memory it needs, without loading.

The model is built from its config.json on the meta device (shapes only, no weights read), placed by the
same code ``serve --device-map`` uses (serve.placement), and the KV cache for ``--max-batch`` x
``--max-seq-len`` is added on each layer's execution device. A compress output holds packed integer
modules only compress.load can build, so for those the (small) model is loaded on the CPU and measured.
"""

from __future__ import annotations

import argparse
import json
import sys

from memfit.defaults import max_seq_len
from memfit.errors import UserError
from memfit.modeldir import check_model_dir, read_config
from serve.options import add_placement_args, check_placement, placement_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve plan", description="Dry run of serve's placement: prints where each "
                                "module would go and the memory each device needs (parameters + KV cache).")
    p.add_argument("model", help="HF checkpoint dir (safetensors) or compress output")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_placement_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = read_config(check_model_dir(args.model), "MODEL")
        if args.max_batch < 1:
            raise UserError("--max-batch must be >= 1")
        msl = max_seq_len(config, args.max_seq_len)
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
    except UserError as e:
        print(f"serve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": args.model, "dtype": str(dtype).removeprefix("torch."), "max_batch": args.max_batch,
                          "max_seq_len": msl, **plan.summary(),
                          "modules": [vars(x) | {"device": str(x.device)} for x in plan.modules]}, indent=1))
    else:
        print(f"plan for {args.model} ({how}); dtype {str(dtype).removeprefix('torch.')}, KV cache for "
              f"--max-batch {args.max_batch} x --max-seq-len {msl}, devices visible: "
              f"{torch.cuda.device_count()} GPU + cpu + disk")
        print(format_plan(plan))
    return 0
