# syntax=docker/dockerfile:1
# The herd orchestrator: `herd orchestrator`, the OpenAI gateway and router in front of the workers.
# Build from the repository root:
#   docker build -f docker/orchestrator.Dockerfile -t herd/orchestrator:0.1.0 .
# The control plane never imports torch, so the image installs the project's requirements without
# it (docker/requirements.py) and then the project itself with --no-deps.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/herd
WORKDIR /src
COPY pyproject.toml README.md ./
COPY docker/requirements.py docker/
RUN python docker/requirements.py --without torch > /tmp/requirements.txt \
    && /opt/herd/bin/pip install --requirement /tmp/requirements.txt
# setuptools maps every herd.<component> package, so every source root must be present.
COPY api api
COPY kube kube
COPY worker worker
COPY orchestrator orchestrator
COPY operator operator
COPY sidecar sidecar
COPY cli cli
RUN /opt/herd/bin/pip install --no-deps .

FROM ${PYTHON_IMAGE}
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin herd
COPY --from=build /opt/herd /opt/herd
# Tokenizers fetched at run time go to /cache (a volume in the chart; the root filesystem is read-only).
ENV PATH=/opt/herd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/cache/huggingface XDG_CACHE_HOME=/cache
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["herd"]
CMD ["orchestrator", "--kubernetes", "--host", "0.0.0.0", "--port", "8000"]
