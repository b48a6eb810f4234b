"""The ``serve`` command as a subprocess: bad input exits 2; SIGTERM drains in-flight requests and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from serve.demo import _wait_healthy

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent/dir"], "not a directory"),
    (["--port", "99999"], "--port"),
    (["--max-batch", "0"], "--max-batch"),
    (["--max-seq-len", "100000"], "max_position_embeddings"),
    (["--dtype", "fp8"], "invalid choice"),
    (["--kv-cache-memory", "2GB"], "--kv-cache-memory: '2GB' is not a size"),
    (["--kv-cache-memory", "-1"], "--kv-cache-memory: '-1' is not a size"),
    (["--kv-cache-memory", "abc"], "--kv-cache-memory: 'abc' is not a size"),
    # the tiny model: 2 layers x 2 KV heads x 16 dims x K,V x fp32 = 512 bytes a token, 8KiB a block of 16
    (["--kv-cache-memory", "100"], "smaller than one KV block"),
    (["--kv-cache-memory", "64KiB", "--max-seq-len", "256"], "one --max-seq-len 256 sequence needs 16: give at "
                                                             "least 128.0KiB"),
    (["--block-size", "0"], "--block-size"),
    (["--kv-cache-dtype", "fp8"], "invalid choice"),
    # int8: 2 layers x 2 KV heads x (16 bytes + a 4-byte scale) x K,V = 160 bytes a token, 2.5KiB a block
    (["--kv-cache-dtype", "int8", "--kv-cache-memory", "2KiB"], "smaller than one KV block (16 tokens in every "
                                                                  "layer: 2.5KiB)"),
    (["--kv-cache", "static", "--kv-cache-memory", "1GiB"], "--kv-cache static"),
])
def test_bad_cli_input_exits_2(model_dir, args, needle):
    if "--model" not in args:
        args = ["--model", model_dir] + args
    r = subprocess.run([sys.executable, "-m", "serve", *args], capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_pickle_only_checkpoint_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    r = subprocess.run([sys.executable, "-m", "serve", "--model", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, env=ENV)
    assert r.returncode == 2 and "pickle" in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_and_exits_0(model_dir):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "serve", "--model", model_dir, "--port", str(port), "--threads", "1",
                          "--max-seq-len", "512", "--log-level", "warning"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        try:
            _wait_healthy(url, p, timeout=90)
        except RuntimeError as e:
            raise AssertionError(f"{e}\n{p.stdout.read() if p.poll() is not None else ''}") from None
        body = {"prompt": "ROMEO.", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        n, sent, last = 0, False, ""
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                last = line
                if line != "data: [DONE]":
                    ch = json.loads(line[6:])
                    if ch.get("usage"):
                        n = ch["usage"]["completion_tokens"]
                if not sent:
                    p.send_signal(signal.SIGTERM)
                    sent = True
        assert last == "data: [DONE]" and n == 400  # the in-flight stream ran to completion
        assert p.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_demo_streams_and_shuts_down(model_dir):
    r = subprocess.run([sys.executable, "-m", "serve.demo", "--model", model_dir, "--max-tokens", "12",
                        "--temperature", "0"], capture_output=True, text=True, timeout=180, env=ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ROMEO.") and len(r.stdout) > len("ROMEO.")
    assert "12 tokens in" in r.stderr
