"""The whole data flow, as CI runs it: train a few steps -> compress quantize --bits 4 -> the container's
entrypoint script (outside Docker) -> a request through the official openai client returns text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve.demo import _free_port as free_port
from serve.demo import _wait_healthy
from training.cli import main as train_main

from .training.conftest import write_corpus

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.mark.slow
def test_train_quantize_serve_openai(tmp_path):
    openai = pytest.importorskip("openai")
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    args = [f"model_config={json.dumps(MODEL)}", "vocab_size=320", f"data={corpus}", "val_files=[doc0.txt]",
            "block_size=64", "batch_size=4", "max_steps=4", "eval_every=4", "save_every=4", f"output_dir={run}"]
    assert train_main(args) == 0

    quant = tmp_path / "q4"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "compress", "quantize", str(run / "last"), "-o", str(quant),
                           "--bits", "4", "--method", "rtn"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((quant / "config.json").read_text())["quantization_config"]

    port = free_port()
    env.update(MEMFIT_MODEL=str(quant), MEMFIT_PORT=str(port), MEMFIT_PYTHON=sys.executable,
               MEMFIT_API_KEY="e2e-secret", MEMFIT_MAX_BATCH="4",
               # a budget below the model: some layers are offloaded to disk and read back every step
               MEMFIT_MAX_MEMORY="cpu=900KB", MEMFIT_MAX_SEQ_LEN="128")
    server = subprocess.Popen(["sh", str(ROOT / "docker" / "entrypoint.sh")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server, timeout=120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="e2e-secret")
        listed = client.models.list().data[0]
        model_id = listed.id
        assert listed.model_extra["placement"]["modules_per_device"].get("disk", 0) >= 1, listed.model_extra
        out = client.completions.create(model=model_id, prompt="thou art the", max_tokens=8, temperature=0)
        assert out.choices[0].text.strip()
        assert out.usage.completion_tokens == 8 or out.choices[0].finish_reason == "stop"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong").models.list()
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert server.returncode == 0  # SIGTERM drains and exits cleanly
