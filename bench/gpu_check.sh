#!/usr/bin/env bash
# The GPU check: memfit's CUDA code paths (tests/{serve,compress,training}/test_cuda.py) on a machine with a GPU.
#
#   bash bench/gpu_check.sh            # from anywhere; runs from the repo root with the machine's python3
#   PYTHON=/path/to/python bash bench/gpu_check.sh
#
# Needs no network and installs nothing: torch (CUDA build), transformers, accelerate, peft, safetensors,
# tokenizers, pyyaml, tqdm and pytest. fastapi/uvicorn/bitsandbytes/compressed-tensors may be absent (the
# tests that need bitsandbytes skip). If $OUT is set, the log, the JUnit XML and the environment report are
# written there. Exit status: pytest's (0 = all passed or skipped/xfailed as expected); 3 if no GPU is visible,
# so an all-skipped run can never pass for a GPU run. Expected: ~1.5-3 min on one H200.
#
# Carried packages: the GPU image may hold older versions than pyproject.toml requires (one H200 image had
# transformers 5.17 / accelerate 1.15, below the >= 5.23 / >= 1.16 floors) and no registry to fetch from. Wheels
# put in .gpu_wheels/wh (git-ignored; carry the folder) are installed into a temp dir ahead of the image's
# packages, and a package folder in .gpu_wheels/site is put on the path as it is. How they were made here:
#   pip download --no-deps -d .gpu_wheels/wh transformers==5.25.0 accelerate==1.16.0
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .gpu_wheels/wh huggingface_hub==2.4.0 kernels==0.19.1 regex   # transformers 5.25's newer deps
#   (cd .gpu_wheels/site && unzip bitsandbytes-*.whl && rm bitsandbytes/*cuda1[12]*.so)  # bnb for cuda13, 4 MB
set -uo pipefail
cd "$(dirname "$0")/.."

if compgen -G ".gpu_wheels/wh/*.whl" >/dev/null; then
  site=$(mktemp -d)
  "${PYTHON:-python3}" -m pip install -q --no-deps --no-index --target "$site" .gpu_wheels/wh/*.whl \
    && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -d .gpu_wheels/site ]; then export PYTHONPATH="$PWD/.gpu_wheels/site${PYTHONPATH:+:$PYTHONPATH}"; fi

PY=${PYTHON:-python3}
OUT_DIR=${OUT:-}
LIMIT=${GPU_CHECK_TIMEOUT:-300}  # seconds for pytest (expected ~2 min): a hang still leaves the log in $OUT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1  # never reach for the hub
export TOKENIZERS_PARALLELISM=false PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONDONTWRITEBYTECODE=1
unset MEMFIT_TEST_DEVICE  # the tests' CPU mode is for machines without a GPU

log() { if [ -n "$OUT_DIR" ]; then tee -a "$OUT_DIR/gpu_check.log"; else cat; fi; }
if [ -n "$OUT_DIR" ]; then mkdir -p "$OUT_DIR" && : > "$OUT_DIR/gpu_check.log"; fi

{
  echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed file(s)"
  echo "== nvidia-smi"
  nvidia-smi 2>&1 || echo "(nvidia-smi failed)"
} 2>&1 | log

# versions and the capabilities the tests rely on, before any test runs (the first thing to read on a failure)
"$PY" - <<'EOF' 2>&1 | log
import importlib.util
import platform
import sys

import torch

print("== python", platform.python_version(), sys.executable)
for name in ("torch", "transformers", "accelerate", "peft", "safetensors", "tokenizers", "pytest", "yaml",
             "tqdm", "httpx", "fastapi", "uvicorn", "bitsandbytes", "compressed_tensors"):
    if importlib.util.find_spec(name) is None:
        print(f"   {name:<20} (not installed)")
        continue
    mod = __import__(name)
    print(f"   {name:<20} {getattr(mod, '__version__', '?')}")
print("== cuda", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    print("   device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
          "bf16:", torch.cuda.is_bf16_supported(), "count:", torch.cuda.device_count())
print("   aten int4 (cuda) ops:", all(hasattr(torch.ops.aten, n) for n in
                                      ("_convert_weight_to_int4pack", "_weight_int4pack_mm")))
from accelerate.hooks import AlignDevicesHook  # noqa: E402
from transformers import PreTrainedModel  # noqa: E402

print("   transformers activation_checkpointing_enable:", hasattr(PreTrainedModel, "activation_checkpointing_enable"))
print("   accelerate AlignDevicesHook._onload_weights:", hasattr(AlignDevicesHook, "_onload_weights"))
EOF

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to $PY: not running the tests (they would all skip)" | log
  exit 3
fi

JUNIT=()
if [ -n "$OUT_DIR" ]; then JUNIT=(--junitxml "$OUT_DIR/gpu_check.junit.xml"); fi
echo "== pytest (limit ${LIMIT}s)" | log
start=$(date +%s)
timeout --kill-after=10 "$LIMIT" "$PY" -m pytest -p no:cacheprovider -rsxX --durations=15 -o console_output_style=classic \
  tests/serve/test_cuda.py tests/compress/test_cuda.py tests/training/test_cuda.py "${JUNIT[@]}" 2>&1 | log
rc=${PIPESTATUS[0]}
echo "== gpu_check: pytest exit $rc after $(( $(date +%s) - start ))s (124 = timed out)" | log
exit "$rc"
