# syntax=docker/dockerfile:1
# The herd operator: `herd operator` (kopf) reconciling ModelDeployments into worker pools.
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t herd/operator:0.1.0 .
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
ENV PATH=/opt/herd/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# kopf's liveness endpoint, when --liveness http://0.0.0.0:8080/healthz is given.
EXPOSE 8080
ENTRYPOINT ["herd"]
CMD ["operator", "--all-namespaces", "--standalone", "--liveness", "http://0.0.0.0:8080/healthz"]
