# syntax=docker/dockerfile:1
# tether-server on one NVIDIA GPU: `tether-server serve` on 0.0.0.0:50051 (gRPC), metrics on 9100.
#
# Build from the repository root (the context must be the root: the image installs the package from source):
#   docker build -f deploy/docker/server.Dockerfile -t tether-server:0.1.0 .
# Run (NVIDIA Container Toolkit on the host; flags after the image name are appended to `tether-server serve`):
#   docker run --gpus 1 -p 50051:50051 -p 9100:9100 tether-server:0.1.0 --max-sessions 128 --kv-pool-mb 4096
#
# torch 2.11.0 on PyPI and in the cu130 index is built for CUDA 13.0; the wheels carry their own CUDA libraries,
# so the base only needs the CUDA 13 user-space shim and a host driver >= 580. Triton compiles a small C launcher
# the first time it runs a kernel, so the runtime stage keeps gcc and the Python headers.
# For reproducible builds pin CUDA_IMAGE by digest (nvidia/cuda:13.0.1-base-ubuntu24.04@sha256:...).
#
# Warm starts: the server compiles and autotunes its Triton kernels at start (34 s in bfloat16 on an H200) unless
# it finds them in its --cache-dir, /var/cache/tether (the ENTRYPOINT's). `docker build` has no GPU, so the image
# cannot carry them: keep that directory on a named volume (-v tether-kernels:/var/cache/tether), which the first
# start fills, once per GPU model, Triton version and image; later containers log `ready in X s (warm cache)`.
# To fill it before the first start, run `tether-server warm` with the same volume (deploy/README.md, section 2).

ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04

# ---- build: a virtual environment with torch and tether[server] ------------------------------------------------
FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/tether/bin:$PATH
# Ubuntu's own python3 (3.12 on 24.04); its package versions follow the base image tag.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/tether
# torch first and pinned: tether only asks for torch>=2.11, and the index decides the CUDA build.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY constraints.txt ./lock.txt
COPY shared ./shared
COPY server ./server
COPY client ./client
COPY kernels ./kernels
COPY netsim ./netsim
COPY proto ./proto
# The project itself; every dependency is pinned by the repository's lock (`make lock`), less the torch stack, which
# torch's own index pinned above.
# hadolint ignore=DL3013
RUN grep -vE '^(torch|triton|nvidia-.*|cuda-.*)==' lock.txt > constraints.txt \
    && pip install --no-cache-dir --constraint constraints.txt ".[server]" \
    && python -c "import tether.server.daemon, grpc_health.v1.health, grpc_reflection.v1alpha.reflection"

# ---- runtime -----------------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/tether/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/tether \
    XDG_CACHE_HOME=/var/cache/tether \
    TRITON_CACHE_DIR=/var/cache/tether/triton
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 tether \
    && useradd --system --uid 10001 --gid tether --home-dir /home/tether --create-home --shell /usr/sbin/nologin tether \
    && install -d -o tether -g tether -m 0750 /var/cache/tether
COPY --from=build /opt/tether /opt/tether
# The default models (24 MB: the target in int8 rows, its MoA drafter); mount real ones over /opt/tether/models or pass --model / --drafter.
COPY deploy/models/target /opt/tether/models/target
COPY deploy/models/drafter /opt/tether/models/drafter
COPY deploy/docker/healthcheck.py /opt/tether/healthcheck.py
USER 10001:10001
WORKDIR /home/tether
EXPOSE 50051 9100
# Docker's own check (Kubernetes ignores it and uses the grpc probes in deploy/k8s): grpc.health.v1 on 50051.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "/opt/tether/healthcheck.py", "127.0.0.1:50051"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["tether-server", "serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100", \
            "--model", "/opt/tether/models/target", "--drafter", "/opt/tether/models/drafter", "--log-format", "json", \
            "--cache-dir", "/var/cache/tether"]
CMD []
