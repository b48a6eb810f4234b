"""Decode-speed section of bench/quantize.py: batch-1 greedy decode of a ~100M random Llama, fp32 vs our int4
vs bitsandbytes NF4, through both decode loops a user meets: serve's static-cache engine (what `serve` runs)
and transformers' own forward with its dynamic cache (what `generate` runs)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from compress.evaluate import decode_speed, format_table, host_isa
from compress.loader import load

ENGINES = ("serve", "hf")


def copy_bandwidth() -> float:
    """Bytes moved (read + write) per second by a 512 MiB tensor copy, best of 5."""
    x = torch.ones(128 * 2**20)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() * 4 / best


def model_bytes(model: torch.nn.Module) -> int:
    """Weight bytes a decode step reads: every parameter and buffer once, except an untied input embedding
    (the lookup reads one row; tied, the same tensor is read whole as lm_head, so it counts)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_ptr = getattr(getattr(head, "weight", None), "data_ptr", lambda: None)()
    seen, total = set(), 0
    if head_ptr != emb.data_ptr():
        seen.add(emb.data_ptr())
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def speed(args: argparse.Namespace, work: Path, quantize: Callable[..., float]) -> tuple[list[dict], dict]:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    fp_dir = work / "random-107m"
    if not (fp_dir / "config.json").is_file():
        cfg = LlamaConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=16,
                          num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                          tie_word_embeddings=True)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(fp_dir)
        vocab = {f"t{i}": i for i in range(8192)}
        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0"))).save_pretrained(
            fp_dir)
    for label, method, extra in (("int4-rtn", "rtn", []), ("int4-rtn-lm_head", "rtn", ["--skip", ""]),
                                 ("nf4-bnb", "nf4", [])):
        if not (work / f"speed-{label}" / "config.json").is_file():
            quantize(fp_dir, work / f"speed-{label}", method, 4, extra, [])
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # see --threads: 2 threads on 2 shared cores stall on the busiest core
    bw = copy_bandwidth()
    paths = (("fp32", fp_dir), ("int4-rtn (ours)", work / "speed-int4-rtn"),
             ("int4-rtn+lm_head (ours)", work / "speed-int4-rtn-lm_head"), ("nf4-bnb", work / "speed-nf4-bnb"))
    # one copy per engine: serve's engine swaps fp32 Linears for oneDNN ones in place (memfit.runtime.dense)
    copies = {engine: {label: load(path) for label, path in paths} for engine in ENGINES}
    models = copies["hf"]
    # round-robin, best of --speed-rounds per model, engine and clock: the cores are shared, so a model measured
    # while another job ran would otherwise look slower than one measured in a quiet moment
    keys = [(label, engine) for engine in ENGINES for label in models]
    wall = dict.fromkeys(keys, 0.0)
    cpu = dict.fromkeys(keys, 0.0)
    for _ in range(args.speed_rounds):
        for label, engine in keys:
            m, n = copies[engine][label], args.decode_tokens
            wall[label, engine] = max(wall[label, engine], decode_speed(m, n, engine=engine))
            cpu[label, engine] = max(cpu[label, engine], decode_speed(m, n, clock=time.process_time, engine=engine))
            print(f"speed {label} ({engine}): {wall[label, engine]:.1f} tok/s wall, {cpu[label, engine]:.1f} CPU",
                  flush=True)
    rows = []
    for label, engine in keys:
        nbytes = model_bytes(models[label])
        rows.append({"engine": engine, "model": label,
                     "params_M": sum(p.numel() for p in models[label].parameters()) / 1e6,
                     "tok_s": wall[label, engine], "tok_s_cpu": cpu[label, engine],
                     "weights_MiB_read_per_token": nbytes / 2**20, "ceiling_tok_s": bw / nbytes,
                     "bandwidth_fraction": wall[label, engine] * nbytes / bw})
    del models, copies
    torch.set_num_threads(threads)
    from importlib.metadata import version

    return rows, {"cpu_isa": host_isa(), "bitsandbytes": version("bitsandbytes"), "copy_bandwidth_GBps": bw / 1e9,
                  "speed_threads": args.threads, "speed_rounds": args.speed_rounds}


def speed_report(srows: list[dict], smeta: dict, args: argparse.Namespace,
                 fmt: Callable[[object], str]) -> tuple[list[str], list[tuple[str, str, bool]]]:
    """The decode-speed section (markdown lines) and its target rows (target, measured, met)."""
    targets: list[tuple[str, str, bool]] = []
    for engine in ENGINES:
        s = {r["model"].split(" ")[0]: r for r in srows if r.get("engine", "hf") == engine}
        if "fp32" not in s:
            continue

        def ratio(a: str, b: str, s=s) -> tuple[float, float]:  # wall-clock and CPU-time tokens/s ratios
            return s[a]["tok_s"] / s[b]["tok_s"], s[a]["tok_s_cpu"] / s[b]["tok_s_cpu"]

        def both(x: tuple[float, float]) -> str:
            return f"{x[0]:.2f}x wall, {x[1]:.2f}x CPU"

        for k in ("int4-rtn", "int4-rtn+lm_head"):
            if k in s:
                x = ratio(k, "fp32")
                targets.append((f"decode ({engine}): {k} >= 2x fp32 (batch 1, ~100M)", both(x), min(x) >= 2))
        for k in ("int4-rtn", "int4-rtn+lm_head"):
            if k in s and "nf4-bnb" in s:
                x = ratio(k, "nf4-bnb")
                need = 10 * s["nf4-bnb"]["tok_s"]
                note = f"; 10x NF4 = {need:.0f} tok/s vs {k}'s bandwidth ceiling {s[k]['ceiling_tok_s']:.0f}"
                targets.append((f"decode ({engine}): {k} >= 10x bnb NF4", both(x) + note, min(x) >= 10))
        for r in s.values():
            r["speed_x_fp32"] = r["tok_s"] / s["fp32"]["tok_s"]
            r["cpu_speed_x_fp32"] = r["tok_s_cpu"] / s["fp32"]["tok_s_cpu"]
    if not srows:
        return [], targets
    lines = ["## Decode speed: random Llama, batch 1, greedy, KV cache", "",
             f"CPU vector extensions: {smeta.get('cpu_isa', 'not recorded')}; {smeta['speed_threads']} torch "
             "thread(s); tokens/s = 1 / median per-token latency over "
             f"{args.decode_tokens} tokens, best of {smeta.get('speed_rounds', 1)} round-robin passes over the "
             "models. `engine`: `serve` = serve's packed forward over a static slot KV cache (what `serve` runs; "
             "int4 QKV and gate/up fused into one kernel call each, fp32 Linears on oneDNN where timed faster "
             "at load), `hf` = the model's own forward with transformers' dynamic cache (what `generate` runs). "
             "`tok_s` from wall-clock time, `tok_s_cpu` from "
             "this process's CPU time (time descheduled by other jobs on the shared cores drops out). "
             f"Measured copy bandwidth (read + write bytes / s, 512 MiB copy): {smeta['copy_bandwidth_GBps']:.1f} "
             "GB/s. `ceiling_tok_s` = that bandwidth / weight bytes read per token (the speed if each token only "
             "had to stream its weights once); `bandwidth_fraction` = tok_s / ceiling. `int4-rtn` keeps lm_head "
             "(the tied embedding) in fp32 by default, which dominates its bytes per token; `int4-rtn+lm_head` "
             "(`--skip \"\"`) quantizes lm_head too (the untied embedding's lookup reads one row, so it is not "
             "counted). NF4 runs bitsandbytes' compiled CPU kernels (bitsandbytes "
             f"{smeta.get('bitsandbytes', '?')}); 10x its speed would be above our int4 models' bandwidth "
             "ceiling, so that target cannot be met on this machine by any kernel that reads its weights.", "",
             format_table([{k: fmt(v) for k, v in r.items()} for r in srows],
                          ["engine", "model", "params_M", "tok_s", "speed_x_fp32", "tok_s_cpu", "cpu_speed_x_fp32",
                           "weights_MiB_read_per_token", "ceiling_tok_s", "bandwidth_fraction"]), ""]
    return lines, targets
