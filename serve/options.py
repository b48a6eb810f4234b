"""Command-line options that ``serve`` and ``serve plan`` share (placement and kernels), with their checks.

Here rather than in serve.cli so that the plan command and the server read the same flags without importing
each other; nothing here imports torch, so bad flags fail fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from memfit.errors import UserError


def add_placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-map", default=None, help="place the model over GPUs, CPU RAM and disk: "
                   "auto|balanced|balanced_low_0|sequential|cpu or a JSON file {module: device} (default: all "
                   "on one device, no accelerate hooks)")
    p.add_argument("--max-memory", default=None, help="per-device budget for --device-map, e.g. "
                   "cuda:0=20GiB,cpu=48GiB (implies --device-map auto); the KV cache is counted in it")
    p.add_argument("--offload-folder", default=None, help="where disk-offloaded tensors that must be converted "
                   "are written (default: a temp dir; safetensors checkpoints are read in place)")
    p.add_argument("--dense-kernel", choices=["auto", "on", "off"], default="auto",
                   help="fp32 CPU Linears packed once at load (memfit.runtime.dense): on memfit's panel kernel "
                        "where --cpu-kernels runs (auto packs them), else through oneDNN (auto times it against "
                        "MKL on the model's largest Linear at load and packs where faster)")
    p.add_argument("--cpu-kernels", choices=["auto", "on", "off"], default="auto",
                   help="memfit's CPU kernels (Linears, norms, RoPE + KV write, attention, the C++ layer loop; "
                        "memfit.runtime.kernels), compiled once per machine with the system C++ compiler (make install "
                        "does it; ~1 min, then cached): auto and on refuse to start if the build fails, off runs "
                        "torch ops (several times slower)")
    p.add_argument("--offload-prefetch", action="store_true",
                   help="load the next offloaded layer on a background thread while the current one runs (off by "
                        "default: on CPU it measured no faster than accelerate's own hooks, bench/placement.py)")


def check_placement(args: argparse.Namespace) -> None:
    dm = args.device_map
    if dm is not None and dm not in ("auto", "balanced", "balanced_low_0", "sequential", "cpu"):
        if not dm.endswith(".json") or not Path(dm).is_file():
            raise UserError(f"--device-map must be auto, balanced, balanced_low_0, sequential, cpu or an existing "
                            f"JSON file, got {dm!r}")
    if args.offload_folder is not None and Path(args.offload_folder).exists() and not Path(
            args.offload_folder).is_dir():
        raise UserError(f"--offload-folder {args.offload_folder} exists and is not a directory")


def placement_from_args(args: argparse.Namespace):
    if args.device_map is None and args.max_memory is None:
        return None
    from serve.placement import Placement, parse_max_memory, read_device_map_file

    dm = args.device_map or "auto"
    return Placement(device_map=read_device_map_file(dm) if dm.endswith(".json") else dm,
                     max_memory=parse_max_memory(args.max_memory), offload_folder=args.offload_folder,
                     prefetch=args.offload_prefetch)
