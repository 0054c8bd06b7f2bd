"""herd.api: the contracts the components share, and nothing else.

It imports nothing from the components. Everything the worker, the orchestrator and the operator
must agree on (the ModelDeployment schema, the OpenAI wire models, the internal worker protocol,
KV block hashing, metric names) lives here.
"""

from herd.api import crd, metrics, openai, protocol
from herd.api.crd import ModelDeployment, ModelDeploymentSpec, RoutingSpec
from herd.api.kv_hash import BlockHash, block_hashes, hash_block, root_hash
from herd.api.manifest import ManifestError, load_manifest, parse_manifest
from herd.api.prompt import PromptError, PromptRenderer

__all__ = [
    "BlockHash",
    "ManifestError",
    "ModelDeployment",
    "ModelDeploymentSpec",
    "PromptError",
    "PromptRenderer",
    "RoutingSpec",
    "block_hashes",
    "crd",
    "hash_block",
    "load_manifest",
    "metrics",
    "openai",
    "parse_manifest",
    "protocol",
    "root_hash",
]
