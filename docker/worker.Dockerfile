# syntax=docker/dockerfile:1
# The herd worker: `herd worker`, the PyTorch engine and its HTTP server, for NVIDIA GPUs.
# Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t herd/worker:0.1.0 .
# torch==2.13.0 from PyPI is the CUDA build on Linux x86_64 and brings its CUDA libraries as wheels,
# so the base image only needs CUDA's compatibility layer; the driver comes from the node (NVIDIA
# container toolkit / GPU operator). The same image serves CPU pools (accelerator vendor none).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
# The `hf` command that the operator's init container runs to fetch hf:// models.
ARG HF_HUB_VERSION=2.4.0

FROM ${CUDA_IMAGE} AS build
ARG HF_HUB_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install --yes --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/herd
WORKDIR /src
COPY pyproject.toml README.md ./
# setuptools maps every herd.<component> package, so every source root must be present.
COPY api api
COPY kube kube
COPY worker worker
COPY orchestrator orchestrator
COPY operator operator
COPY sidecar sidecar
COPY cli cli
RUN /opt/herd/bin/pip install . "huggingface_hub==${HF_HUB_VERSION}"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install --yes --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/herd --shell /usr/sbin/nologin herd
COPY --from=build /opt/herd /opt/herd
ENV PATH=/opt/herd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/herd
# Public OpenAI port and the token-guarded internal port (the operator's --port / --internal-port).
EXPOSE 8000 9000
ENTRYPOINT ["herd"]
CMD ["worker", "--help"]
