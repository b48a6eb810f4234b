"""memfit's quantizers side by side with llm-compressor, AutoRound, HQQ and bitsandbytes on a real model.

    python bench/quantize_peers.py [--model .cache/models/gemma3-270m] [--only LABEL ...] [--eval-tokens 4096]
        [--autoround-iters 50] [--redo LABEL ...] [--rounds N]

Every variant quantizes the decoder-layer Linears only (q/k/v/o/gate/up/down_proj; embeddings and lm_head stay
as they are) from the same fp32 HF dir, calibrated methods on the same 128 x 512 calibration tokens (drawn by
compress.calib from the Shakespeare training split; `bench/quant_peers.py calib` writes the same draw for the
peers). Evaluation: the held-out plays (compress.calib.HELD_OUT, never in the calibration draw), windows of 512
tokens (BOS + 511 text tokens, like the calibration windows: compress.calib.bos_id): perplexity, mean per-token
KL(fp32 || quantized) and top-1 agreement with the fp32 model. Every model is evaluated in fp32 (memfit outputs
through compress.load's exact dequantize path, peers' dequantized HF dirs through plain transformers), so the
numbers compare the quantizers, not the kernels.

Size: bytes of the packed quantized Linear tensors (codes, scales, zero points) as each format stores them
(memfit: our compressed-tensors file; peers: the packed size their runner reports), as bits per weight.
Time: quantization wall time (memfit: the CLI run; peers: the runner's quantize call), peak RSS of the process.

--rounds N quantizes each selected variant N times, interleaved (round 1 of every variant, then round 2, ...),
and reports the median time with every round's time beside it: this host is shared and noisy.
Each variant's result is cached in .cache/bench/quantize_peers/LABEL/result.json, so an interrupted run resumes
(--redo LABEL measures one again). Writes bench/results/quantize_peers.md, .json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compress import calib, evaluate  # noqa: E402
from compress.evaluate import cpu_model, host_isa  # noqa: E402
from compress.store import WeightSource  # noqa: E402

WORK = ROOT / ".cache" / "bench" / "quantize_peers"
RESULTS = ROOT / "bench" / "results"
SEQLEN = 512
# the size-budget rows: one sensitivity measurement (512 tokens, the CLI default) cached for all of them
SENSITIVITY = ["--sensitivity-tokens", "512", "--sensitivity", str(WORK / "sensitivity.json")]

# label -> (tool, method, bits, group, extra CLI args)
VARIANTS: dict[str, tuple[str, str, int, int, list[str]]] = {
    "memfit-rtn-4": ("memfit", "rtn", 4, 128, []),
    "memfit-rtn-4-clip": ("memfit", "rtn", 4, 128, ["--mse-clip"]),
    "memfit-gptq-4": ("memfit", "gptq", 4, 128, []),  # the default: asymmetric, act-order, clipping search
    "memfit-gptq-4-noclip": ("memfit", "gptq", 4, 128, ["--no-mse-clip"]),
    "memfit-gptq-4-noact": ("memfit", "gptq", 4, 128, ["--no-act-order", "--no-mse-clip"]),
    "memfit-gptq-4-sym": ("memfit", "gptq", 4, 128, ["--sym", "--no-mse-clip"]),
    "memfit-gptq-4-sym-noact": ("memfit", "gptq", 4, 128, ["--sym", "--no-act-order", "--no-mse-clip"]),
    "memfit-gptq-4-sym-mse": ("memfit", "gptq", 4, 128, ["--sym", "--mse-clip"]),
    "memfit-awq-4": ("memfit", "awq", 4, 128, []),
    "memfit-nf4": ("memfit", "nf4", 4, 64, []),
    "llmcompressor-gptq-4": ("peer", "llmcompressor", 4, 128, []),
    "llmcompressor-gptq-4-asym": ("peer", "llmcompressor", 4, 128, ["--asym"]),
    "autoround-4": ("peer", "autoround", 4, 128, []),
    "hqq-4": ("peer", "hqq", 4, 128, []),
    "bnb-nf4": ("peer", "bnb", 4, 64, []),
    "memfit-rtn-3": ("memfit", "rtn", 3, 128, []),
    "memfit-rtn-3-clip": ("memfit", "rtn", 3, 128, ["--mse-clip"]),
    "memfit-gptq-3": ("memfit", "gptq", 3, 128, []),
    "memfit-gptq-3-noclip": ("memfit", "gptq", 3, 128, ["--no-mse-clip"]),
    "memfit-gptq-3-sym": ("memfit", "gptq", 3, 128, ["--sym", "--no-mse-clip"]),
    "memfit-gptq-3-sym-mse": ("memfit", "gptq", 3, 128, ["--sym", "--mse-clip"]),
    "memfit-awq-3": ("memfit", "awq", 3, 128, []),
    "llmcompressor-gptq-3": ("peer", "llmcompressor", 3, 128, []),
    "autoround-3": ("peer", "autoround", 3, 128, []),
    "hqq-3": ("peer", "hqq", 3, 128, []),
    "memfit-rtn-4-g32": ("memfit", "rtn", 4, 32, []),
    "memfit-gptq-4-g32": ("memfit", "gptq", 4, 32, []),
    "llmcompressor-gptq-4-g32": ("peer", "llmcompressor", 4, 32, []),
    # the size budget at memfit-gptq-4's tensor bytes: mixed widths chosen by measured sensitivity (bits 0: no --bits)
    "memfit-gptq-mixed@4": ("memfit", "gptq", 0, 128, ["--max-size", "@memfit-gptq-4", *SENSITIVITY]),
    "memfit-gptq-mixed@3": ("memfit", "gptq", 0, 128, ["--max-size", "@memfit-gptq-3", *SENSITIVITY]),
    "memfit-gptq-mixed@4-noclip": ("memfit", "gptq", 0, 128, ["--max-size", "@memfit-gptq-4", "--no-mse-clip",
                                                              *SENSITIVITY]),
    "memfit-gptq-mixed@3-noclip": ("memfit", "gptq", 0, 128, ["--max-size", "@memfit-gptq-3", "--no-mse-clip",
                                                              *SENSITIVITY]),
    # the size budget at the best peer's own bits per weight: memfit-gptq-4's file with its quantized Linears
    # at the peer's packed bytes (the "same bits per weight", with no slack; the rest of the file, fp16
    # embedding and norms, is the same at every width)
    "memfit-gptq-mixed=llmcompressor-4-asym": ("memfit", "gptq", 0, 128, [
        "--max-size", "@memfit-gptq-4%llmcompressor-gptq-4-asym", *SENSITIVITY]),
    "memfit-gptq-mixed=autoround-3": ("memfit", "gptq", 0, 128, ["--max-size", "@memfit-gptq-4%autoround-3",
                                                                 *SENSITIVITY]),
    "memfit-gptq-mixed=llmcompressor-4-asym-noclip": ("memfit", "gptq", 0, 128, [
        "--max-size", "@memfit-gptq-4%llmcompressor-gptq-4-asym", "--no-mse-clip", *SENSITIVITY]),
    "memfit-gptq-mixed=autoround-3-noclip": ("memfit", "gptq", 0, 128, [
        "--max-size", "@memfit-gptq-4%autoround-3", "--no-mse-clip", *SENSITIVITY]),
}


def this_host() -> str:
    """What a result row records of where it was measured (cached rows can come from an earlier boot)."""
    return f"{cpu_model()} ({host_isa()}), {time.strftime('%Y-%m-%d', time.gmtime())}"


def budget_bytes(ref: str) -> int:
    """`@LABEL`: LABEL's tensor bytes; `@LABEL%PEER`: the same with LABEL's packed Linears at PEER's packed bytes."""
    label, _, peer = ref[1:].partition("%")
    size = tensor_bytes(WORK / label / "model")
    if peer:
        peer_packed = json.loads((WORK / peer / "result.json").read_text())["packed_bytes"]
        size += peer_packed - packed_bytes(WORK / label / "model")
    return size


def tensor_bytes(model: Path) -> int:
    src = WeightSource(model)
    return sum(src.get(k).numel() * src.get(k).element_size() for k in src.keys())


# Peak RSS through a small wrapper process: a child forked straight from this one (which holds GBs of
# reference logits) would report this process's RSS as its own peak (Linux keeps the high-water mark over exec).
_WRAP = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); open(sys.argv[1], 'w').write("
         "str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)); sys.exit(rc)")


def _run(argv: list[str], log: Path) -> tuple[float, int]:
    """Run argv (2 threads), logging to log: (wall seconds, peak RSS bytes of argv's process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    rss_file = log.with_suffix(".rss")
    t0 = time.monotonic()
    with log.open("w") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        rc = subprocess.call([sys.executable, "-c", _WRAP, str(rss_file), *argv], env=env, stdout=f,
                             stderr=subprocess.STDOUT, cwd=ROOT)
    if rc:
        raise RuntimeError(f"{argv[:4]} failed; see {log}")
    return time.monotonic() - t0, int(rss_file.read_text())


def quantize(label: str, model: Path, calib_file: Path, autoround_iters: int) -> dict[str, Any]:
    tool, method, bits, group, extra = VARIANTS[label]
    out = WORK / label / "model"
    log = WORK / label / "quantize.log"
    if tool == "memfit":
        extra = [str(budget_bytes(x)) if x.startswith("@") else x for x in extra]
        argv = [sys.executable, "-m", "compress", "quantize", str(model), "-o", str(out), "--overwrite",
                "--method", method, *(["--bits", str(bits)] if bits else []), "--group-size", str(group), *extra]
        if method in ("gptq", "awq"):
            argv += ["--calib", *map(str, calib.default_calib_files()), "--calib-samples", "128",
                     "--calib-seqlen", str(SEQLEN)]
        secs, rss = _run(argv, log)
        return {"quant_seconds": round(secs, 1), "peak_rss_bytes": rss, "packed_bytes": packed_bytes(out),
                "how": "compress CLI wall time (model load + calibration + quantize + write)"}
    argv = [sys.executable, str(ROOT / "bench" / "quant_peers.py"), "run", method, "--model", str(model),
            "--calib", str(calib_file), "--bits", str(bits), "--group-size", str(group), "--out", str(out)]
    if method == "autoround":
        argv += ["--iters", str(autoround_iters)]
    argv += extra
    _run(argv, log)
    meta = json.loads((out / "peer.json").read_text())
    return {"quant_seconds": meta.get("quant_seconds"), "peak_rss_bytes": meta.get("peak_rss_bytes"),
            "packed_bytes": meta.get("packed_bytes"), "wall_seconds": meta.get("wall_seconds"),
            "how": "the runner's quantize call (model load excluded); wall_seconds: the whole runner",
            "peer": {k: meta[k] for k in ("version", "settings", "packed_bytes_how") if k in meta}}


LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight")


def packed_bytes(out: Path) -> int:
    """Bytes of the decoder-layer Linear weights as stored: compressed-tensors weight_* tensors, bitsandbytes'
    4-bit weights and quant state, or fp16 weights a size budget kept (everything under `...proj.weight`)."""
    src = WeightSource(out)
    return sum(src.get(k).numel() * src.get(k).element_size() for k in src.keys() if LINEAR.search(k))


def load_eval_model(label: str):
    from transformers import AutoModelForCausalLM

    from compress.loader import load

    out = WORK / label / "model"
    if VARIANTS[label][0] == "memfit":
        return load(out, backend="dequant") if VARIANTS[label][1] != "nf4" else load(out)
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, use_safetensors=True).eval()


@torch.no_grad()
def reference(model: Path, tokens: torch.Tensor, bos: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    fp = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, use_safetensors=True).eval()
    windows = [w for ws in evaluate.windows(tokens, SEQLEN, bos) if ws.shape[1] == SEQLEN for w in ws.split(1)]
    logp = [torch.log_softmax(fp(input_ids=w).logits[0].float(), -1) for w in windows]
    return windows, logp


@torch.no_grad()
def score(m, windows: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, float]:
    """ppl (next token), mean per-token KL(fp || m) and top-1 agreement over the same windows."""
    nll = kl = agree = count = 0.0
    for w, lp in zip(windows, ref, strict=True):
        lq = torch.log_softmax(m(input_ids=w).logits[0].float(), -1)
        nll += float(torch.nn.functional.nll_loss(lq[:-1], w[0, 1:], reduction="sum"))
        kl += float((lp.exp() * (lp - lq)).sum())
        agree += float((lp.argmax(-1) == lq.argmax(-1)).sum())
        count += lp.shape[0]
    n_next = count - len(windows)
    return {"ppl": float(torch.tensor(nll / n_next).exp()), "kl": kl / count, "top1": agree / count}


def n_quantized_weights(model: Path) -> int:
    src = WeightSource(model)
    return sum(src.get(k).numel() for k in src.keys() if LINEAR.search(k) and k.endswith(".weight"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / ".cache" / "models" / "gemma3-270m")
    ap.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    ap.add_argument("--redo", nargs="*", default=[], help="labels measured again even if cached")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--autoround-iters", type=int, default=50)
    ap.add_argument("--report-only", action="store_true", help="write the report from the cached results")
    ap.add_argument("--rounds", type=int, default=1, help="quantize each variant this many times, interleaved; "
                    "the median time is reported")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        print(f"--rounds must be >= 1, got {a.rounds}", file=sys.stderr)
        return 2
    if not (a.model / "config.json").is_file():
        print(f"{a.model}: no model (make real-model)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    torch.set_num_threads(2)
    labels = [x for x in VARIANTS if a.only is None or x in a.only]
    WORK.mkdir(parents=True, exist_ok=True)
    calib_file = WORK / "calib-128x512.safetensors"
    if not calib_file.exists():
        subprocess.run([sys.executable, str(ROOT / "bench" / "quant_peers.py"), "calib", "--model", str(a.model),
                        "-n", "128", "--seqlen", str(SEQLEN), "--out", str(calib_file)], check=True)
    from memfit.hf import load_tokenizer

    tok = load_tokenizer(str(a.model))
    tokens, bos = calib.eval_tokens(tok, calib.default_eval_files(), a.eval_tokens), calib.bos_id(tok)
    ref = None
    n_w = n_quantized_weights(a.model)
    todo = [x for x in labels if not (WORK / x / "result.json").exists() or x in a.redo]
    runs: dict[str, list[dict[str, Any]]] = {x: [] for x in todo}
    for r in range(a.rounds if not a.report_only else 0):  # interleaved: every variant once per round
        for label in todo:
            if runs[label] and "failed" in runs[label][-1]:
                continue
            print(f"[quantize_peers] {label}: quantizing (round {r + 1}/{a.rounds})", flush=True)
            try:
                runs[label].append(quantize(label, a.model, calib_file, a.autoround_iters))
            except Exception as e:  # recorded, the rest go on
                print(f"[quantize_peers] {label}: FAILED {e}", flush=True)
                runs[label].append({"failed": str(e)})
    for label in todo if not a.report_only else []:
        res_file = WORK / label / "result.json"
        res_file.parent.mkdir(parents=True, exist_ok=True)
        if "failed" in runs[label][-1]:
            res_file.write_text(json.dumps({"label": label, **runs[label][-1]}, indent=2))
            continue
        res = dict(runs[label][-1])  # the last round's output is the one scored (every round writes the same)
        if len(runs[label]) > 1:
            times = sorted(x["quant_seconds"] for x in runs[label])
            res.update(quant_seconds=times[len(times) // 2],
                       quant_seconds_rounds=[x["quant_seconds"] for x in runs[label]],
                       peak_rss_bytes=max(x["peak_rss_bytes"] or 0 for x in runs[label]))
        if ref is None:
            print("[quantize_peers] fp32 reference logits", flush=True)
            ref = reference(a.model, tokens, bos)
        m = load_eval_model(label)
        res.update(score(m, *ref), label=label, bits_per_weight=res["packed_bytes"] * 8 / n_w
                   if res.get("packed_bytes") else None, host=this_host())
        del m
        res_file.write_text(json.dumps(res, indent=2))
        print(f"[quantize_peers] {label}: KL {res['kl']:.4f} top1 {res['top1']:.4f} ppl {res['ppl']:.3f} "
              f"{res['quant_seconds']}s", flush=True)
    if ref is None and not (WORK / "fp32.json").exists():
        ref = reference(a.model, tokens, bos)
    if ref is not None and not (WORK / "fp32.json").exists():
        from transformers import AutoModelForCausalLM

        fp = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, use_safetensors=True).eval()
        (WORK / "fp32.json").write_text(json.dumps({**score(fp, *ref), "tokens": sum(w.numel() for w in ref[0])}))
    report(a, n_w)
    return 0


def report(a: argparse.Namespace, n_w: int) -> None:
    from bench.quantize_peers_report import write_report

    rows = []
    for label in VARIANTS:
        f = WORK / label / "result.json"
        if f.exists():
            rows.append({"label": label, **json.loads(f.read_text())})
    fp = json.loads((WORK / "fp32.json").read_text())
    host = {"cpu": cpu_model(), "isa": host_isa(), "run": this_host(), "threads": 2,
            "torch": torch.__version__, "max_rss_bench": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    write_report(rows, fp, VARIANTS, a, n_w, fp["tokens"], host, RESULTS)


if __name__ == "__main__":
    sys.exit(main())
