"""Fuzz the server's own OpenAPI schema with schemathesis: no request may produce a 5xx.

    python bench/serve_schemathesis.py [--max-time 120] [--model DIR]

Starts `serve` on a tiny random Llama (built in a tmp dir with a small BPE tokenizer, or --model) on
127.0.0.1, runs `st run <url>/openapi.json --checks not_a_server_error`, writes the summary to
bench/results/serving_schemathesis.txt and exits with schemathesis' exit code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-time", type=int, default=120)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    model = args.model
    if model is None:
        from tests.serve.conftest import make_model_dir

        model = str(make_model_dir(Path(tempfile.mkdtemp(prefix="st-model-"))))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # max_tokens is capped by the 128-token context, keeping every fuzzed generation short
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--model", model, "--port", str(port), "--max-seq-len",
                             "128", "--max-batch", "4", "--log-level", "warning"], env=env)
    try:
        for _ in range(300):
            try:
                if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        st = str(Path(sys.executable).parent / "st")
        cmd = [st, "run", url + "/openapi.json", "--checks", "not_a_server_error", "--max-time", str(args.max_time),
               "--workers", "2", "--suppress-health-check", "all"]
        print(" ".join(cmd), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        out = r.stdout + r.stderr
        print(out[-6000:])
        res = ROOT / "bench" / "results"
        res.mkdir(parents=True, exist_ok=True)
        summary = out[max(0, out.find("=== SUMMARY")):]
        for head in ("=== FAILURES", "=== ERRORS"):
            if head in out:  # keep the start of each section (tracebacks of schemathesis' own errors are long)
                summary = out[out.find(head):][:3000] + "\n...\n" + summary
        (res / "serving_schemathesis.txt").write_text(f"$ {' '.join(cmd)}\n(exit {r.returncode})\n\n{summary}")
        alive = proc.poll() is None
        print(f"server still alive after fuzzing: {alive}")
        return r.returncode if alive else 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
