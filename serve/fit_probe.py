"""One ``serve fit`` verification run: serve's own load and engine, with serve's flags, at the workload's shape.

``python -m serve.fit_probe [probe flags] -- [serve flags]`` builds the engine exactly as ``serve`` would (the
same parser, validation, ServeConfig and State.load; no HTTP), then

1. submits ``--running`` sequences of ``--prompt`` random tokens at once, each to generate ``--decode-steps`` + 1
   tokens greedily (EOS ignored): the prefill phase (submit -> every sequence's first token) and the decode
   phase (then the last token; every step decodes ``--running`` rows) are timed. A workload that takes less
   than MIN_TIMED_S runs again with new prompts (the shipped 5M model's takes about 1 s; one command line's
   timings varied by 10-20% between processes on a shared host) and the phases' medians are reported;
2. with ``--ref FILE`` (serve.fit_quality: the unquantized model's log-probabilities on held-out text), feeds that
   text through the engine's model one token per row and step and measures the KL divergence and top-1 agreement.

It prints one line ``FITPROBE {json}``: RSS after imports, after the load, once ready, the process peak
(VmHWM: loading included) before the quality phase, and the phase timings. ``--base-only`` stops after the
imports and the tokenizer: what every candidate holds besides its weights, KV cache and workspace.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

from memfit.heap import status_kib

PREFIX = "FITPROBE "
MIN_TIMED_S = 5.0
"""Seconds of timed work (prefill + decode phases, over the repeats) a verification run gathers at least."""
MAX_REPEATS = 15


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="serve.fit_probe", description=__doc__)
    p.add_argument("--running", type=int, default=1, help="sequences submitted at once")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps timed after the prefill phase")
    p.add_argument("--ref", default=None, help="serve.fit_quality reference file: measure KL and top-1 too")
    p.add_argument("--base-only", action="store_true", help="imports and tokenizer only")
    return p


def _run_workload(engine, vocab: int, running: int, prompt: int, steps: int) -> dict:
    """The workload's phase timings: one run, or the medians of as many as MIN_TIMED_S needs."""
    rng = random.Random(0)
    runs = [_run_once(engine, vocab, running, prompt, steps, rng)]
    while sum(r["prefill_s"] + r["decode_s"] for r in runs) < MIN_TIMED_S and len(runs) < MAX_REPEATS:
        runs.append(_run_once(engine, vocab, running, prompt, steps, rng))
    out = {k: statistics.median(r[k] for r in runs) for k in ("prefill_s", "decode_s", "decode_step_s")}
    return out | {"decode_steps": steps, "repeats": len(runs)}


def _run_once(engine, vocab: int, running: int, prompt: int, steps: int, rng: random.Random) -> dict:
    from serve.sampling import SamplingParams
    from serve.sequence import Sequence

    first: dict[int, float] = {}
    last: dict[int, float] = {}
    done = threading.Event()
    lock = threading.Lock()
    errors: list[str] = []

    def sink_for(i: int):
        def sink(ev) -> None:
            now = time.perf_counter()
            with lock:
                if ev.error is None:  # one Event per generated token (the last one carries the finish)
                    first.setdefault(i, now)
                    last[i] = now
                if ev.error:
                    errors.append(ev.error)
                if ev.finish_reason is not None:
                    finished.add(i)
                    if len(finished) == running:
                        done.set()
        return sink

    finished: set[int] = set()
    # distinct random prompts: identical ones would share their KV blocks through the prefix cache
    seqs = [Sequence([rng.randrange(3, vocab) for _ in range(prompt)],
                     SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True), sink_for(i), vocab)
            for i in range(running)]
    t0 = time.perf_counter()
    engine.submit(seqs)
    if not done.wait(3600):
        raise RuntimeError("the workload did not finish within an hour")
    if errors:
        raise RuntimeError(f"the engine failed a sequence: {errors[0]}")
    t_first = max(first.values())
    t_end = max(last.values())
    return {"prefill_s": t_first - t0, "decode_s": t_end - t_first, "decode_steps": steps,
            "decode_step_s": (t_end - t_first) / max(1, steps)}


def _touch_kv(sm) -> None:
    """Write the whole KV cache, as a server under the full workload does: allocated zeroed, its pages are not
    resident until written, and a short run writes only the blocks it uses."""
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        for t in getattr(sm, name, None) or []:
            if t is not None:
                t.zero_()


def _quality(sm, ref_path: str) -> dict:
    """Teacher-forced decode of the reference text through the engine's model: KL(ref || served) per token."""
    import torch
    from safetensors import safe_open

    from memfit.runtime.kv_groups import blocks_for
    from memfit.runtime.slot_model import Segment

    with safe_open(ref_path, "pt") as f:
        tokens = f.get_tensor("tokens")
        rows, length = tokens.shape
        rows, length = min(rows, sm.max_batch), min(length, sm.max_seq_len)  # the candidate's own limits
        if getattr(sm, "paged", False):
            k = blocks_for(length, sm.block_size)
            rows = min(rows, sm.num_blocks // (k * len(sm.kv_groups)))
            sm.assign_blocks(rows, k)
        kl_sum, agree, n = 0.0, 0, 0
        for t in range(length - 1):
            logits = sm.forward(tokens[:rows, t].contiguous(), [Segment(r, t, 1) for r in range(rows)])
            q = torch.log_softmax(logits.float(), dim=-1)
            ref = torch.log_softmax(f.get_slice("logp")[:rows, t].float(), -1)  # stored as fp16: renormalize
            p = ref.exp()
            kl_sum += float((p * (ref - q)).sum(-1).clamp_min(0).sum())
            agree += int((ref.argmax(-1) == q.argmax(-1)).sum())
            n += rows
    return {"kl": kl_sum / n, "top1": agree / n, "quality_tokens": n}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    probe = build_parser().parse_args(argv[:cut])
    serve_argv = argv[cut + 1:]
    from memfit.errors import UserError
    from serve.cli import build_parser as serve_parser
    from serve.cli import validate

    args = serve_parser().parse_args(serve_argv)
    out: dict = {}
    try:
        validate(args)
        import torch

        from memfit.hf import load_tokenizer
        from serve.api import ServeConfig, State  # everything a server imports
        from serve.options import placement_from_args

        if args.threads:
            torch.set_num_threads(args.threads)
        if probe.base_only:  # the process before any weight: imports, the model's code and modules (on the
            # meta device), the tokenizer, the kernels
            import torch

            from serve.placement import meta_model

            model = meta_model(args.model, torch.float32)  # noqa: F841 - held while RSS is read
            before = status_kib("VmRSS") * 1024
            tok = load_tokenizer(args.model, flag="--model")  # noqa: F841
            out["rss_tokenizer"] = status_kib("VmRSS") * 1024 - before
            if args.cpu_kernels != "off":
                from memfit.runtime import kernels

                kernels.load(args.cpu_kernels)
            out["rss_base"] = status_kib("VmRSS") * 1024
            print(PREFIX + json.dumps(out), flush=True)
            return 0
        out["rss_imports"] = status_kib("VmRSS") * 1024
        cfg = ServeConfig(model_path=args.model, dtype=args.dtype, quantize=args.quantize,
                          quantize_embeddings=args.quantize_embeddings, max_batch=args.max_batch,
                          max_seq_len=args.max_seq_len, prefill_chunk=args.prefill_chunk, max_queue=args.max_queue,
                          placement=placement_from_args(args), dense_kernel=args.dense_kernel,
                          cpu_kernels=args.cpu_kernels, kv_cache=args.kv_cache, kv_cache_memory=args.kv_budget,
                          block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
                          prefix_caching=not args.no_prefix_cache, engine_on_event_loop=False)
        from serve.loader import load

        def load_fn():
            loaded = load(cfg.model_path, cfg.dtype, cfg.quantize, placement=cfg.placement, max_batch=cfg.max_batch,
                          max_seq_len=cfg.max_seq_len, quantize_embeddings=cfg.quantize_embeddings,
                          cpu_kernels=cfg.cpu_kernels)
            out["rss_loaded"] = status_kib("VmRSS") * 1024
            return loaded

        t0 = time.perf_counter()
        state = State(cfg, load_fn)
        state.load()
        if state.status != "ready":
            raise UserError(f"the engine did not start: {state.error}")
        out["load_s"] = time.perf_counter() - t0
        out["rss_ready"] = status_kib("VmRSS") * 1024
        out["hwm_load"] = status_kib("VmHWM") * 1024
        engine = state.engine
        out["kv_cache_bytes"] = int(engine.model.cache_bytes)
        _touch_kv(engine.model)
        out["engine"] = state.placement.get("engine")
        out["linear_formats"] = state.placement.get("linear_formats")
        out.update(_run_workload(engine, int(state.loaded.model.config.vocab_size), probe.running, probe.prompt,
                                 probe.decode_steps))
        engine.stop()
        out["rss_after"] = status_kib("VmRSS") * 1024
        out["peak"] = status_kib("VmHWM") * 1024
        if probe.ref:
            with torch.inference_mode():
                out.update(_quality(engine.model, probe.ref))
    except UserError as e:
        print(f"serve.fit_probe: error: {e}", file=sys.stderr)
        print(PREFIX + json.dumps(out | {"error": str(e)}), flush=True)
        return 2
    print(PREFIX + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # the engine's thread and the kernels' pools: nothing left to flush


if __name__ == "__main__":
    sys.exit(main())
