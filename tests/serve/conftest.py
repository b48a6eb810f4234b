"""Fixtures: a tiny random Llama + BPE tokenizer saved to a tmp dir (no hub), engines and live servers."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from training.tokenizer import train_bpe

TEXT = """ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.
JULIET. O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name.
HAMLET. To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer
the slings and arrows of outrageous fortune, or to take arms against a sea of troubles.
MACBETH. Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day.
PROSPERO. We are such stuff as dreams are made on, and our little life is rounded with a sleep.
"""


@pytest.fixture(autouse=True, scope="session")
def _cpu_kernels_built():
    """Build memfit.runtime.kernels (~1 min on a fresh machine) before any test, not inside a live server's load, where
    it would count against that fixture's wait for /health (``pytest tests/serve`` alone on a fresh clone)."""
    from memfit.runtime import kernels

    kernels.load("auto")


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny models: intra-op threads only add sync overhead (and stall badly on a loaded 2-core box).
    Scoped to this directory's tests; other packages' tests keep torch's setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model_dir(path, seed: int = 0, layers: int = 2, hidden: int = 64, maxpos: int = 512):
    tok = train_bpe([TEXT] * 4, 400)
    tok.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=maxpos, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=0.2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return str(make_model_dir(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def loaded(model_dir):
    from serve.loader import load

    return load(model_dir)


class LiveServer:
    """uvicorn on 127.0.0.1:<free port> in a thread (signal handlers stay with pytest)."""

    def __init__(self, app):
        # imported here, not at module level: the CUDA tests in this folder run where uvicorn/httpx may be absent
        import uvicorn

        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, wait_ready: bool = True):
        import httpx

        self.thread.start()
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if not wait_ready or r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.state.status == "failed":
                raise RuntimeError(f"server failed to load: {self.state.error}")
            time.sleep(0.05)
        raise RuntimeError("server did not become ready")

    @property
    def state(self):
        return self.app.state.serve

    def stop(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def make_server(model_dir, loaded=None, wait_ready=True, **kw):
    from serve.api import ServeConfig, create_app

    cfg = ServeConfig(model_path=model_dir, served_name="tiny", **kw)
    app = create_app(cfg, load_fn=(lambda: loaded) if loaded is not None else None)
    return LiveServer(app).start(wait_ready)


@pytest.fixture(scope="module")
def server(model_dir, loaded):
    s = make_server(model_dir, loaded, max_batch=4, max_seq_len=256, prefill_chunk=16, max_queue=16)
    yield s
    s.stop()


def hf_greedy(loaded, ids: list[int], max_new: int) -> list[int]:
    m = loaded.model
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def slot_greedy(sm, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from a SlotModel for one prompt in slot 0: one prefill, then decodes."""
    from memfit.runtime.slot_model import Segment

    lg = sm.forward(torch.tensor(prompt), [Segment(0, 0, len(prompt))])
    out = [int(lg[0].argmax())]
    for i in range(n - 1):
        lg = sm.forward(torch.tensor([out[-1]]), [Segment(0, len(prompt) + i, 1)])
        out.append(int(lg[0].argmax()))
    return out
