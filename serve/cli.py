"""``serve`` command: start the OpenAI-compatible server (see ``serve --help``)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

from memfit.defaults import DEFAULT_MODEL, default_model, max_seq_len
from memfit.errors import UserError
from memfit.modeldir import check_model_dir, read_config
from serve.kv_config import (
    DEFAULT_PREFILL_CHUNK,
    add_kv_args,
    check_kv_args,
    guess_kv_elem_bytes,
    kv_layout,
    kv_torch_dtype,
    num_kv_blocks,
)
from serve.options import add_placement_args, check_placement, placement_from_args

log = logging.getLogger("serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve", description="OpenAI-compatible generation server with continuous "
                                "batching, chunked prefill, streaming and Prometheus metrics.")
    p.add_argument("--model", default=None, help=f"HF checkpoint dir (safetensors) or compress output "
                   f"(default: {DEFAULT_MODEL})")
    p.add_argument("--served-model-name", default=None, help="name clients use in 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="bf16: Linear weights in bf16 on memfit's CPU kernels, activations and KV cache fp32 (half "
                        "the bytes per token); auto: bf16 where the CPU has AVX512-BF16, else fp32. Models run by "
                        "torch ops (placed, --tp, nf4, --cpu-kernels off) get this dtype whole (auto: fp32)")
    p.add_argument("--quantize", choices=["nf4", "int8"], default=None,
                   help="quantize the decoder Linears at load (int8: torch dynamic; nf4: bitsandbytes)")
    p.add_argument("--quantize-embeddings", choices=["int8", "int4"], default=None,
                   help="store the lm_head and input embedding as int8 rows (one scale per row: a quarter of the "
                        "bytes a decode step reads for a large vocabulary, Gemma 3: 671 -> 168 MB) or 4-bit "
                        "(groups of 32, int4 kernels; a tied table is then held twice, and on Gemma 3 it costs "
                        "far more quality than int8); opt-in, the costs are in bench/results/embeddings.md")
    p.add_argument("--max-batch", type=int, default=16, help="max sequences running at once (static KV cache: "
                   "its slots)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context per sequence, prompt + output (default: min(max_position_embeddings, 2048))")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK,
                   help=f"max prompt tokens prefilled per step (default {DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--max-queue", type=int, default=64, help="max sequences waiting for a slot; more get 429")
    add_kv_args(p)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env MEMFIT_API_KEY)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before cancelling them")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the engine (default: torch's, i.e. OMP_NUM_THREADS or all "
                        "cores; with --tp N, cores / N per rank). On a 2-core box 2 threads beat 1 at every "
                        "concurrency when the box is otherwise idle (bench/results/serving.md); set 1 on a busy one")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_placement_args(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: launch with `torchrun "
                   "--nproc-per-node N -m serve --tp N` (gloo on CPU, NCCL on GPU); rank 0 serves HTTP")
    return p


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
    if args.tp > 1 and (args.device_map or args.max_memory or args.quantize or args.quantize_embeddings):
        raise UserError("--tp cannot be combined with --device-map/--max-memory/--quantize/--quantize-embeddings")
    check_placement(args)
    if args.graceful_timeout < 0:
        raise UserError("--graceful-timeout must be >= 0")
    args.kv_budget = check_kv_args(args)
    if args.kv_budget is not None and (args.tp > 1 or args.device_map or args.max_memory):
        raise UserError("--kv-cache-memory: placed (--device-map/--max-memory) and tensor-parallel (--tp) models "
                        "run a static KV cache (--max-batch x --max-seq-len)")
    cfg = read_config(check_model_dir(args.model, "--model"), "--model")
    msl = max_seq_len(cfg, args.max_seq_len)  # refuses < 2 and past the model's window
    if args.kv_budget is not None:  # checked again with the loaded model's exact KV dtype
        lay = kv_layout(cfg, guess_kv_elem_bytes(args.dtype, args.cpu_kernels), args.kv_cache_dtype,
                        args.block_size, msl)
        num_kv_blocks(args.kv_budget, lay, args.max_batch, msl, args.prefill_chunk)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:
        from serve.plan import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.model is None:
        args.model = default_model()
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
        placement = placement_from_args(args)
        if args.tp > 1:
            from serve import tp

            if tp.init(args.tp) != 0:
                return _tp_worker(args)
    except UserError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 2

    from serve.api import ServeConfig, create_app

    cfg = ServeConfig(model_path=args.model, served_name=args.served_model_name, dtype=args.dtype,
                      quantize=args.quantize, quantize_embeddings=args.quantize_embeddings, max_batch=args.max_batch,
                      max_seq_len=args.max_seq_len,
                      prefill_chunk=args.prefill_chunk, max_queue=args.max_queue, api_key=args.api_key,
                      max_body_bytes=args.max_body_bytes, placement=placement, tp=args.tp,
                      dense_kernel=args.dense_kernel, cpu_kernels=args.cpu_kernels,
                      kv_cache=args.kv_cache, kv_cache_memory=args.kv_budget, block_size=args.block_size,
                      kv_cache_dtype=args.kv_cache_dtype,
                      prefix_caching=not args.no_prefix_cache, engine_on_event_loop=True)
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
    if args.tp > 1:
        from serve import tp

        if state.engine is not None and hasattr(state.engine.model, "close"):
            state.engine.model.close()  # the workers exit after rank 0's last step
        tp.finish()
    if failure:
        e = failure[0]
        print(f"serve: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1
    if not server.started:
        return 1
    return 0


def _tp_worker(args: argparse.Namespace) -> int:
    """Ranks 1..N-1 of ``--tp N``: load this rank's shard, then run the steps rank 0 broadcasts."""
    from memfit.runtime.generic import make_runner
    from serve import tp
    from serve.loader import load

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains on SIGTERM and then tells us to stop
    try:
        loaded = load(args.model, args.dtype, None, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                      tp=args.tp)
    except UserError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 2
    msl = max_seq_len(loaded.model.config, args.max_seq_len)  # as rank 0's State.load
    try:  # tensor parallel runs on the packed engine only: an architecture it lacks is refused, as on rank 0
        sm = make_runner(loaded.model, args.max_batch, msl, generic_ok=False, dense_kernel=args.dense_kernel,
                         cpu_kernels=args.cpu_kernels, cache_dtype=kv_torch_dtype(args.kv_cache_dtype))
    except UserError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 2
    tp.worker_loop(sm)
    tp.finish()
    return 0


def entry() -> None:
    sys.exit(main())
