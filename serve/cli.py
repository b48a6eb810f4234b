"""``serve`` command: start the OpenAI-compatible server (see ``serve --help``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from training.errors import UserError

DEFAULT_MODEL = "models/shakespeare-llama"  # as in serve.loader; here so bad input fails before importing torch

log = logging.getLogger("serve")


def _default_model() -> str:
    repo = Path(__file__).resolve().parent.parent / DEFAULT_MODEL
    return str(repo) if repo.is_dir() and not Path(DEFAULT_MODEL).is_dir() else DEFAULT_MODEL


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve", description="OpenAI-compatible generation server with continuous "
                                "batching, chunked prefill, streaming and Prometheus metrics.")
    p.add_argument("--model", default=None, help=f"HF checkpoint dir (safetensors) or compress output "
                   f"(default: {DEFAULT_MODEL})")
    p.add_argument("--served-model-name", default=None, help="name clients use in 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="auto = fp32 on CPU")
    p.add_argument("--quantize", choices=["nf4", "int8"], default=None,
                   help="quantize the decoder Linears at load (int8: torch dynamic; nf4: bitsandbytes)")
    p.add_argument("--max-batch", type=int, default=16, help="KV-cache slots = max concurrent sequences")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context per slot, prompt + output (default: min(max_position_embeddings, 2048))")
    p.add_argument("--prefill-chunk", type=int, default=256, help="max prompt tokens prefilled per step")
    p.add_argument("--max-queue", type=int, default=64, help="max sequences waiting for a slot; more get 429")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env MEMFIT_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before cancelling them")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the engine (default: torch's, i.e. OMP_NUM_THREADS or all "
                        "cores; with --tp N, cores / N per rank). On a 2-core box 2 threads beat 1 at every "
                        "concurrency when the box is otherwise idle (bench/results/serving.md); set 1 on a busy one")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _placement_args(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: launch with `torchrun "
                   "--nproc-per-node N -m serve --tp N` (gloo on CPU, NCCL on GPU); rank 0 serves HTTP")
    return p


def _placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-map", default=None, help="place the model over GPUs, CPU RAM and disk: "
                   "auto|balanced|balanced_low_0|sequential|cpu or a JSON file {module: device} (default: all "
                   "on one device, no accelerate hooks)")
    p.add_argument("--max-memory", default=None, help="per-device budget for --device-map, e.g. "
                   "cuda:0=20GiB,cpu=48GiB (implies --device-map auto); the KV cache is counted in it")
    p.add_argument("--offload-folder", default=None, help="where disk-offloaded tensors that must be converted "
                   "are written (default: a temp dir; safetensors checkpoints are read in place)")
    p.add_argument("--dense-kernel", choices=["auto", "on", "off"], default="auto",
                   help="fp32 CPU Linears through oneDNN on weights reordered once at load (serve/dense.py): auto "
                        "times both kernels on the model's largest Linear at load and uses oneDNN where faster")
    p.add_argument("--cpu-kernels", choices=["auto", "on", "off"], default="auto",
                   help="fused fp32 CPU kernels for RMSNorm, RoPE + KV cache write and decode attention "
                        "(serve/kernels.py), compiled once per machine with the system C++ compiler (~40 s, then "
                        "cached): auto falls back to torch ops if the build fails, on makes that an error")
    p.add_argument("--offload-prefetch", action="store_true",
                   help="load the next offloaded layer on a background thread while the current one runs (off by "
                        "default: on CPU it measured no faster than accelerate's own hooks, bench/placement.py)")


def _check_placement(args: argparse.Namespace) -> None:
    dm = args.device_map
    if dm is not None and dm not in ("auto", "balanced", "balanced_low_0", "sequential", "cpu"):
        if not dm.endswith(".json") or not Path(dm).is_file():
            raise UserError(f"--device-map must be auto, balanced, balanced_low_0, sequential, cpu or an existing "
                            f"JSON file, got {dm!r}")
    if args.offload_folder is not None and Path(args.offload_folder).exists() and not Path(
            args.offload_folder).is_dir():
        raise UserError(f"--offload-folder {args.offload_folder} exists and is not a directory")


def validate(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    for name, lo, hi in (("max_batch", 1, 1024), ("prefill_chunk", 1, 1 << 20), ("max_queue", 0, 1 << 20),
                         ("max_body_bytes", 1024, 1 << 30)):
        v = getattr(args, name)
        if not lo <= v <= hi:
            raise UserError(f"--{name.replace('_', '-')} must be in {lo}..{hi}, got {v}")
    if args.threads is not None and not 1 <= args.threads <= 1024:
        raise UserError(f"--threads must be in 1..1024, got {args.threads}")
    if not 1 <= args.tp <= 64:
        raise UserError(f"--tp must be in 1..64, got {args.tp}")
    if args.tp > 1 and (args.device_map or args.max_memory or args.quantize):
        raise UserError("--tp cannot be combined with --device-map/--max-memory/--quantize")
    _check_placement(args)
    if args.graceful_timeout < 0:
        raise UserError("--graceful-timeout must be >= 0")
    # the same checks as training.model.check_checkpoint_dir (run again at load), without importing torch
    m = Path(args.model)
    if not m.is_dir():
        raise UserError(f"--model: {args.model} is not a directory")
    if not (m / "config.json").is_file():
        raise UserError(f"--model: {args.model} has no config.json")
    if not any(m.glob("*.safetensors")):
        pickle = any(m.glob("*.bin")) or any(m.glob("*.pt")) or any(m.glob("*.pth"))
        raise UserError(f"--model: {args.model} has no *.safetensors weights"
                        + (" (pickle-only checkpoints are refused: they can run arbitrary code when loaded)"
                           if pickle else ""))
    try:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--model: unreadable config.json: {e}") from None
    maxpos = cfg.get("max_position_embeddings")
    if args.max_seq_len is not None:
        if args.max_seq_len < 2:
            raise UserError(f"--max-seq-len must be >= 2, got {args.max_seq_len}")
        if maxpos and args.max_seq_len > maxpos:
            raise UserError(f"--max-seq-len {args.max_seq_len} exceeds the model's max_position_embeddings {maxpos}")


def _placement(args: argparse.Namespace):
    if args.device_map is None and args.max_memory is None:
        return None
    from serve.placement import Placement, parse_max_memory, read_device_map_file

    dm = args.device_map or "auto"
    return Placement(device_map=read_device_map_file(dm) if dm.endswith(".json") else dm,
                     max_memory=parse_max_memory(args.max_memory), offload_folder=args.offload_folder,
                     prefetch=args.offload_prefetch)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        from serve.plan import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.model is None:
        args.model = _default_model()
    args.api_key = args.api_key or os.environ.get("MEMFIT_API_KEY") or None
    try:
        validate(args)
    except UserError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch
    import uvicorn

    if args.threads:
        torch.set_num_threads(args.threads)
    elif args.tp > 1 and "OMP_NUM_THREADS" not in os.environ:  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    try:
        placement = _placement(args)
        if args.tp > 1:
            from serve import tp

            if tp.init(args.tp) != 0:
                return _tp_worker(args)
    except UserError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 2

    from serve.api import ServeConfig, create_app

    cfg = ServeConfig(model_path=args.model, served_name=args.served_model_name, dtype=args.dtype,
                      quantize=args.quantize, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                      prefill_chunk=args.prefill_chunk, max_queue=args.max_queue, api_key=args.api_key,
                      max_body_bytes=args.max_body_bytes, placement=placement, tp=args.tp,
                      dense_kernel=args.dense_kernel, cpu_kernels=args.cpu_kernels,
                      engine_on_event_loop=True)
    app = create_app(cfg)
    state = app.state.serve
    failure: list[BaseException] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM/SIGINT: stop admitting, let in-flight requests finish
            if state.status in ("ready", "loading"):
                state.status = "draining"
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):  # ours are installed below: uvicorn's re-raise the signal at exit (rc -15)
            yield

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.graceful_timeout, access_log=False,
                                   loop="asyncio"))  # run_async yields on asyncio's run queue

    def on_failed(e: BaseException) -> None:
        failure.append(e)
        server.should_exit = True

    state.on_failed = on_failed
    # One thread does both: the engine steps as a task on uvicorn's event loop, which handles the HTTP I/O
    # between steps (serve/engine.py: run_async); on the process's main thread, where the engine ran
    # 1.3-1.6x faster than on a second one (Engine.__init__). SIGTERM/SIGINT call handle_exit above: stop
    # admitting, let in-flight requests finish (uvicorn's graceful shutdown), then the lifespan stops the engine.
    signal.signal(signal.SIGTERM, server.handle_exit)
    signal.signal(signal.SIGINT, server.handle_exit)
    log.info("serve: model %s on http://%s:%d (health 503 until loaded)", args.model, args.host, args.port)
    server.run()
    if args.tp > 1 and state.engine is not None and hasattr(state.engine.model, "close"):
        state.engine.model.close()  # the workers exit after rank 0's last step
    if failure:
        e = failure[0]
        print(f"serve: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1
    if not server.started:
        return 1
    return 0


def _tp_worker(args: argparse.Namespace) -> int:
    """Ranks 1..N-1 of ``--tp N``: load this rank's shard, then run the steps rank 0 broadcasts."""
    from serve import tp
    from serve.loader import load
    from serve.model import SlotModel

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains on SIGTERM and then tells us to stop
    try:
        loaded = load(args.model, args.dtype, None, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                      tp=args.tp)
    except UserError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 2
    msl = args.max_seq_len or min(loaded.max_positions, 2048)  # as rank 0's State.load
    tp.worker_loop(SlotModel(loaded.model, args.max_batch, msl, dense_kernel=args.dense_kernel,
                             cpu_kernels=args.cpu_kernels))
    return 0


def entry() -> None:
    sys.exit(main())
