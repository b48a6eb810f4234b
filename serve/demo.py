"""``python -m serve.demo``: start the server on the shipped model, stream one completion with the
official openai client, print it as it arrives, shut the server down (SIGTERM) and exit.

Options: --model DIR (default models/shakespeare-llama), --prompt TEXT, --max-tokens N, --chat.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from memfit.defaults import default_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not healthy after {timeout:.0f}s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serve.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--prompt", default="ROMEO.")
    p.add_argument("--max-tokens", type=int, default=80)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions with the chat template")
    args = p.parse_args(argv)
    model = args.model or default_model()
    if not os.path.isdir(model):
        print(f"serve.demo: error: model dir {model} not found (train it or pass --model)", file=sys.stderr)
        return 2
    import openai

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--model", model, "--port", str(port),
                             "--log-level", "warning"])
    try:
        _wait_healthy(url, proc, 180)
        client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("MEMFIT_API_KEY", "none"))
        print(f"# streaming from {model} via {url}/v1 (openai client)\n", file=sys.stderr)
        t0 = time.time()
        n = 0
        if args.chat:
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": args.prompt}],
                                                    max_tokens=args.max_tokens, temperature=args.temperature,
                                                    seed=0, stream=True, stream_options={"include_usage": True})
            sys.stdout.write(args.prompt + "\n")
        else:
            stream = client.completions.create(model=model, prompt=args.prompt, max_tokens=args.max_tokens,
                                               temperature=args.temperature, seed=0, stream=True,
                                               stream_options={"include_usage": True})
            sys.stdout.write(args.prompt)
        for chunk in stream:
            if chunk.usage is not None:
                n = chunk.usage.completion_tokens
            for c in chunk.choices:
                text = c.delta.content if args.chat else c.text
                sys.stdout.write(text or "")
                sys.stdout.flush()
        dt = time.time() - t0
        print(f"\n\n# {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s)", file=sys.stderr)
        return 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())
