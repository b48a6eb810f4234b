#!/bin/sh
# The image's entrypoint (CI runs this same script outside Docker): `serve` configured by env vars.
#   MEMFIT_MODEL        model dir (HF checkpoint or compress output)   default: the shipped model
#   MEMFIT_HOST/PORT    bind address                                  default: 127.0.0.1:8000 (image: 0.0.0.0)
#   MEMFIT_API_KEY      require this bearer key (read by serve itself; never put it on the command line)
#   MEMFIT_MAX_BATCH    concurrent sequences (KV-cache slots)         default: 16
#   MEMFIT_MAX_SEQ_LEN  context per sequence                          default: the model's (capped at 2048)
#   MEMFIT_QUANTIZE     nf4|int8: quantize at load                    default: off
#   MEMFIT_THREADS      torch CPU threads                             default: torch's choice
#   MEMFIT_PYTHON       interpreter                                   default: python3
# Extra arguments are passed to serve unchanged.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
model=${MEMFIT_MODEL:-$here/../models/shakespeare-llama}
set -- --model "$model" --host "${MEMFIT_HOST:-127.0.0.1}" --port "${MEMFIT_PORT:-8000}" \
  --max-batch "${MEMFIT_MAX_BATCH:-16}" "$@"
if [ -n "${MEMFIT_MAX_SEQ_LEN:-}" ]; then set -- "$@" --max-seq-len "$MEMFIT_MAX_SEQ_LEN"; fi
if [ -n "${MEMFIT_QUANTIZE:-}" ]; then set -- "$@" --quantize "$MEMFIT_QUANTIZE"; fi
if [ -n "${MEMFIT_THREADS:-}" ]; then set -- "$@" --threads "$MEMFIT_THREADS"; fi
exec "${MEMFIT_PYTHON:-python3}" -m serve "$@"
