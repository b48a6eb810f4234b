"""Heavier soak: N requests (default 500) at concurrency C (default 32) with 20% client disconnects,
against `serve` in a subprocess. Checks every completed greedy answer against offline HF `generate`,
that the running/waiting gauges and KV usage return to 0, and that the server's RSS is stable.

    python bench/serve_soak.py [--requests 500] [--concurrency 32] [--model DIR]

Writes bench/results/serving_soak.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ["ROMEO. But soft", "JULIET. O Romeo", "To be, or not to be", "MACBETH. Tomorrow, and tomorrow, " * 4,
           "We are such stuff as dreams", "HAMLET.", "the slings and arrows of outrageous fortune, " * 6, "O",
           "PROSPERO. Our revels now are ended", "KING LEAR. Blow, winds, and crack your cheeks! " * 3]


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def main_async(args, url: str, expected: dict, proc: psutil.Process) -> dict:
    rng = random.Random(0)
    jobs = [(rng.randrange(len(PROMPTS)), rng.choice((8, 32)), rng.random() < 0.5, rng.random() < 0.2)
            for _ in range(args.requests)]
    stats = {"ok": 0, "wrong": 0, "disconnected": 0, "errors": 0, "rss_mib": []}
    lock = asyncio.Lock()
    done = 0

    async def run(client, job):
        pi, mt, stream, disconnect = job
        body = {"prompt": PROMPTS[pi], "max_tokens": mt, "temperature": 0, "ignore_eos": True, "stream": stream}
        if disconnect:
            try:
                if stream:
                    async with client.stream("POST", url + "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                break
                else:
                    await client.post(url + "/v1/completions", json=body, timeout=0.02)
            except httpx.TimeoutException:
                pass
            return "disconnected"
        text = ""
        if stream:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return "errors"
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += "".join(c.get("text", "") for c in json.loads(line[6:]).get("choices", []))
        else:
            r = await client.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                return "errors"
            text = r.json()["choices"][0]["text"]
        return "ok" if text == expected[(pi, mt)] else "wrong"

    queue = list(jobs)

    async def worker(client):
        nonlocal done
        while queue:
            job = queue.pop()
            try:
                k = await run(client, job)
            except httpx.HTTPError:
                k = "errors"
            async with lock:
                stats[k] += 1
                done += 1
                if done % 50 == 0:
                    stats["rss_mib"].append(round(proc.memory_info().rss / 2 ** 20, 1))

    t0 = time.time()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency + 8)) as client:
        await asyncio.gather(*[worker(client) for _ in range(args.concurrency)])
    stats["wall_s"] = round(time.time() - t0, 1)
    return stats


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    import torch

    from serve.loader import load

    torch.set_num_threads(1)
    model = args.model
    if model is None:
        from tests.serve.conftest import make_model_dir

        model = str(make_model_dir(Path(tempfile.mkdtemp(prefix="soak-model-"))))
    L = load(model)
    expected = {}
    for pi, p in enumerate(PROMPTS):
        ids = L.tokenizer(p)["input_ids"]
        with torch.no_grad():
            out = L.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=32, do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(ids):]
        for mt in (8, 32):
            expected[(pi, mt)] = L.tokenizer.decode(out[:mt].tolist(), skip_special_tokens=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "serve", "--model", model, "--port", str(port), "--max-batch", "16",
                          "--max-queue", "64", "--max-seq-len", "256", "--threads", "1", "--log-level", "warning"],
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        proc = psutil.Process(p.pid)
        rss0 = proc.memory_info().rss / 2 ** 20
        stats = asyncio.run(main_async(args, url, expected, proc))
        time.sleep(0.5)
        m = httpx.get(url + "/metrics", timeout=10).text
        stats["running_after"] = metric(m, "memfit:num_requests_running")
        stats["waiting_after"] = metric(m, "memfit:num_requests_waiting")
        stats["kv_usage_after"] = metric(m, "memfit:kv_cache_usage_perc")
        stats["rss_start_mib"] = round(rss0, 1)
        stats["rss_end_mib"] = round(proc.memory_info().rss / 2 ** 20, 1)
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(60)
    stats["exit_code"] = rc
    r = stats["rss_mib"]
    growth = (r[-1] - r[len(r) // 2]) if len(r) >= 2 else 0.0
    ok = (stats["wrong"] == 0 and stats["errors"] == 0 and stats["running_after"] == 0 and
          stats["waiting_after"] == 0 and rc == 0 and growth < 20)
    lines = ["# Serving soak", "", f"`python bench/serve_soak.py --requests {args.requests} --concurrency "
             f"{args.concurrency}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}), tiny random Llama, "
             "greedy, 50% streaming, 20% client disconnects (after the first chunk or a 20 ms timeout).", "",
             "| metric | value |", "|---|---|"]
    for k, v in stats.items():
        lines.append(f"| {k} | {v} |")
    lines += ["", f"RSS growth over the second half of the run: {growth:.1f} MiB. Result: "
              f"{'PASS' if ok else 'FAIL'}."]
    out = ROOT / "bench" / "results" / "serving_soak.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
