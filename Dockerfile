# syntax=docker/dockerfile:1
# Slotkeeper: `slotkeeper serve` by default; the chart runs `slotkeeper gateway` and `slotkeeper node`.
#
#   docker build -t slotkeeper:0.1.0 .
#   docker run --rm -p 8000:8000 -v $PWD/models:/models slotkeeper:0.1.0 serve --model /models/m.gguf
#
# Without Docker, .ci/build-image builds it with buildah on a stand-in BASE made from Debian's
# python3.11 (tests/helm/test_image.py runs the result). llama.cpp is compiled for x86-64-v3
# (AVX2/FMA/F16C), not for the build machine's CPU, so the image runs on any such machine; pass
# CMAKE_ARGS to change that (a CUDA variant: docs/container.md).

# Both stages start from BASE: a Debian bookworm with python3.11, and `python` and `pip` on PATH.
ARG BASE=python:3.11-slim-bookworm

# -- build: wheels for llama-cpp-python (compiled once) and for slotkeeper (its native module) ----
FROM ${BASE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*
ARG CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF"
ARG BUILD_JOBS=4
ENV CMAKE_ARGS=${CMAKE_ARGS} CMAKE_BUILD_PARALLEL_LEVEL=${BUILD_JOBS} PIP_NO_CACHE_DIR=1
# The pinned llama-cpp-python first: slotkeeper's isolated build environment then takes this wheel
# (PIP_FIND_LINKS) instead of compiling llama.cpp a second time.
RUN pip wheel --wheel-dir /wheels llama-cpp-python==0.3.36
ENV PIP_FIND_LINKS=/wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY native native
COPY engine_pool engine_pool
COPY gateway gateway
COPY storage storage
RUN pip wheel --wheel-dir /wheels .

# -- runtime: slim, non-root, state and models on volumes -------------------------------------------
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 1000 slotkeeper \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /var/lib/slotkeeper slotkeeper \
 && mkdir -p /var/lib/slotkeeper /models \
 && chown 1000:1000 /var/lib/slotkeeper
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels slotkeeper && rm -rf /wheels
# Read-only root filesystem friendly: everything written goes to the data volume (slot files, spill
# cache, engine logs; HOME and the working directory too) or to /tmp — the chart mounts volumes at
# both and runs with readOnlyRootFilesystem; `docker run --read-only` needs `--tmpfs /tmp`.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/var/lib/slotkeeper \
    SLOTKEEPER_DATA_DIR=/var/lib/slotkeeper SLOTKEEPER_HOST=0.0.0.0
VOLUME ["/var/lib/slotkeeper", "/models"]
WORKDIR /var/lib/slotkeeper
USER 1000:1000
EXPOSE 8000 8070
ENTRYPOINT ["slotkeeper"]
CMD ["serve"]
