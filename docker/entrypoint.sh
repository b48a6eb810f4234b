#!/bin/sh
# The image's entrypoint (CI runs this same script outside Docker): `serve` configured by env vars.
#   MEMFIT_MODEL        model dir (HF checkpoint or compress output)   default: the shipped model
#   MEMFIT_HOST/PORT    bind address                                  default: 127.0.0.1:8000 (image: 0.0.0.0)
#   MEMFIT_API_KEY      require this bearer key (read by serve itself; never put it on the command line)
#   MEMFIT_MAX_BATCH    concurrent sequences (KV-cache slots)         default: 16
#   MEMFIT_MAX_SEQ_LEN  context per sequence                          default: the model's (capped at 2048)
#   MEMFIT_QUANTIZE     nf4|int8: quantize at load                    default: off
#   MEMFIT_THREADS      torch CPU threads                             default: torch's choice
#   MEMFIT_DEVICE_MAP   auto|balanced|sequential|cpu|FILE.json         default: all on one device
#   MEMFIT_MAX_MEMORY   e.g. cuda:0=20GiB,cpu=48GiB (offloads the rest to disk; implies device map auto)
#   MEMFIT_OFFLOAD_FOLDER  dir for disk-offloaded tensors             default: a temp dir
#   MEMFIT_TP           tensor-parallel ranks (torchrun inside the container) default: 1
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
if [ -n "${MEMFIT_DEVICE_MAP:-}" ]; then set -- "$@" --device-map "$MEMFIT_DEVICE_MAP"; fi
if [ -n "${MEMFIT_MAX_MEMORY:-}" ]; then set -- "$@" --max-memory "$MEMFIT_MAX_MEMORY"; fi
if [ -n "${MEMFIT_OFFLOAD_FOLDER:-}" ]; then set -- "$@" --offload-folder "$MEMFIT_OFFLOAD_FOLDER"; fi
py=${MEMFIT_PYTHON:-python3}
if [ "${MEMFIT_TP:-1}" != 1 ]; then
  # rank 0 serves HTTP; torchrun stops every rank on SIGTERM (no drain: run replicas for rolling updates)
  exec "$py" -m torch.distributed.run --nproc-per-node "$MEMFIT_TP" -m serve --tp "$MEMFIT_TP" "$@"
fi
exec "$py" -m serve "$@"
