"""Short soak: 60 requests at concurrency 16, 20% client disconnects; every completed answer is correct."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from serve.kv_config import kv_bytes_per_token

from .conftest import hf_greedy, make_server, metric

PROMPTS = ["ROMEO. But soft", "JULIET. O Romeo", "To be, or not to be", "MACBETH. Tomorrow, and tomorrow, " * 4,
           "We are such stuff as dreams", "HAMLET.", "the slings and arrows of outrageous fortune, " * 6, "O"]


def test_soak_60_requests_concurrency_16_with_disconnects(model_dir, loaded):
    # a paged cache of 36 blocks of 8 (288 positions, 1.1 --max-seq-len) for 8 running sequences: preemptions,
    # and prefix hits (the prompts repeat)
    bpb = kv_bytes_per_token(loaded.model.config, 4) * 8
    s = make_server(model_dir, loaded, max_batch=8, max_seq_len=256, prefill_chunk=32, max_queue=32,
                    kv_cache_memory=36 * bpb, block_size=8)
    tok = loaded.tokenizer
    expected = {}
    for p in PROMPTS:
        for mt in (8, 24):
            ids = tok(p)["input_ids"]
            expected[(p, mt)] = tok.decode(hf_greedy(loaded, ids, mt), skip_special_tokens=True)
    rng = random.Random(0)
    jobs = [(PROMPTS[rng.randrange(len(PROMPTS))], rng.choice((8, 24)), rng.random() < 0.5, rng.random() < 0.2)
            for _ in range(60)]
    s.state.engine.step_hook = lambda segs: time.sleep(0.002)  # make disconnects land mid-generation

    def run(job):
        prompt, mt, stream, disconnect = job
        body = {"model": "tiny", "prompt": prompt, "max_tokens": mt, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if disconnect:
            if stream:
                with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            break  # drop the connection after the first chunk
            else:
                try:
                    httpx.post(s.url + "/v1/completions", json=body, timeout=0.01)
                except httpx.TimeoutException:
                    pass
            return job, None
        if stream:
            text = ""
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        ch = json.loads(line[6:])
                        text += "".join(c["text"] for c in ch["choices"])
            return job, text
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return job, r.json()["choices"][0]["text"]

    try:
        with ThreadPoolExecutor(16) as ex:
            results = list(ex.map(run, jobs))
        done = [(j, t) for j, t in results if t is not None]
        assert len(done) >= 40
        for (prompt, mt, _stream, _d), text in done:
            assert text == expected[(prompt, mt)], (prompt, mt)
        deadline = time.time() + 5
        m = ""
        while time.time() < deadline:
            m = httpx.get(s.url + "/metrics", timeout=10).text
            if metric(m, "memfit:num_requests_running") == 0 and metric(m, "memfit:num_requests_waiting") == 0:
                break
            time.sleep(0.05)
        assert metric(m, "memfit:num_requests_running") == 0
        assert metric(m, "memfit:num_requests_waiting") == 0
        assert metric(m, "memfit:kv_cache_usage_perc") == 0
        assert metric(m, 'memfit:request_success_total{finished_reason="abort"}') >= 1
        eng = s.state.engine
        assert sorted(eng.free_slots) == list(range(8))
        assert eng.kv_leaks() == []  # every block back in the pool, not just the gauge at 0
        assert metric(m, "memfit:kv_cache_blocks_free") == metric(m, "memfit:kv_cache_blocks_total") == 36
        assert metric(m, "memfit:prefix_cache_hits_total") == eng.pool.hits > 0
        assert metric(m, "memfit:num_preemptions_total") == eng.scheduler.num_preemptions  # timing: 0 to a few
    finally:
        s.stop()
