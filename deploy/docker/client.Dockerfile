# syntax=docker/dockerfile:1
# tether-client on a CPU (an edge box, a CI job): drafts with onnxruntime (`--backend onnx`, the default) from the
# ONNX client part the server exports, so the image holds no torch (tether[client]: numpy, onnxruntime, gRPC).
#
# Build from the repository root:
#   docker build -f deploy/docker/client.Dockerfile -t tether-client:0.1.0 .
# Run (the cache volume keeps the downloaded client part between runs; add --precision int8 for a quarter of the
# bytes):
#   docker run --rm -v tether-cache:/var/cache/tether -e TETHER_API_KEY tether-client:0.1.0 generate \
#       --server tether.example.com:443 --tls-ca /certs/ca.pem --prompt "def main():" --json
# (the key comes from the environment, TETHER_API_KEY, or --api-key-file: on the command line ps would show it)
# generate and chat get `--backend onnx --cache-dir /var/cache/tether` first; flags you pass come later and win.
# `--backend torch` needs torch, which this image leaves out: it is there to compare against, and for servers too
# old to offer the ONNX part.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build ---------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/tether/bin:$PATH
RUN python -m venv /opt/tether
WORKDIR /src
COPY pyproject.toml README.md ./
COPY constraints.txt ./constraints.txt
# Every package of the distribution, as pyproject.toml maps them (the wheel holds them all; the client imports no
# server or kernel module, and the client extra brings none of their dependencies).
COPY shared ./shared
COPY server ./server
COPY client ./client
COPY kernels ./kernels
COPY netsim ./netsim
COPY proto ./proto
# The project itself; every dependency is pinned by the repository's lock (`make lock`; its torch lines go unused: the
# client extra brings no torch). Then the session
# must import, and without torch.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --constraint constraints.txt ".[client]" \
    && python -c "import sys, onnxruntime, tether.client.session; assert 'torch' not in sys.modules"

# ---- runtime ---------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ENV PATH=/opt/tether/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/tether
RUN groupadd --system --gid 10001 tether \
    && useradd --system --uid 10001 --gid tether --home-dir /home/tether --create-home --shell /usr/sbin/nologin tether \
    && install -d -o tether -g tether -m 0750 /var/cache/tether
COPY --from=build /opt/tether /opt/tether
COPY --chmod=0755 deploy/docker/client-entrypoint.sh /usr/local/bin/tether-client-entrypoint
USER 10001:10001
WORKDIR /home/tether
VOLUME ["/var/cache/tether"]
ENTRYPOINT ["tether-client-entrypoint"]
CMD ["info"]
