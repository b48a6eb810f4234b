# memfit serving image: CPU by default; CUDA through build args, e.g.
#   docker build -t memfit .
#   docker build -t memfit:cuda --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_SPEC="torch==2.13.0" --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# CUDA base images ship no Python: install one (a no-op on python:* images, which have it).
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
      apt-get update && apt-get install -y --no-install-recommends python3 python3-venv && \
      rm -rf /var/lib/apt/lists/*; fi
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# torch first, from the index that matches the base image (CPU wheel by default: ~200 MB, not ~3 GB);
# TORCH_SPEC carries the pin, which hadolint cannot see through the build arg.
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY memfit ./memfit
COPY training ./training
COPY compress ./compress
COPY serve ./serve
RUN pip install .

FROM ${BASE_IMAGE} AS runtime
# g++: memfit.runtime.kernels compiles its CPU kernels (memfit/runtime/csrc, -march=native) where they run, once
# per container into ~/.cache/torch_extensions (~40 s at the first start); without it serve falls back to
# torch ops (several times slower per decode step on CPU).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && \
    if ! command -v python3 >/dev/null; then apt-get install -y --no-install-recommends python3 python3-dev; fi && \
    rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 1000 memfit
COPY --from=build /opt/venv /opt/venv
COPY --chown=memfit:memfit models/shakespeare-llama /app/models/shakespeare-llama
COPY --chown=memfit:memfit docker/entrypoint.sh /app/entrypoint.sh
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    MEMFIT_MODEL=/app/models/shakespeare-llama \
    MEMFIT_HOST=0.0.0.0 \
    MEMFIT_PORT=8000
WORKDIR /app
# user models: mount a dir here and set MEMFIT_MODEL=/models/<name>
VOLUME ["/models"]
USER 1000:1000
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('MEMFIT_PORT', '8000')}/health\", timeout=4)"]
ENTRYPOINT ["/app/entrypoint.sh"]
