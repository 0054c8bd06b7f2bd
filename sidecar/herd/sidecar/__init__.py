"""herd.sidecar: herd's worker contract in front of a vLLM server, in the vLLM pod.

It imports ``herd.api`` only (no torch): the orchestrator reads it exactly as it reads a herd worker,
so that it needs no vLLM special case. Its KV events are vLLM's, re-hashed with herd's block hashing.
"""

from herd.sidecar._serve import SidecarOptions, serve

__all__ = ["SidecarOptions", "serve"]
