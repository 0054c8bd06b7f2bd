"""The internal worker protocol: what the orchestrator and peer workers exchange with a worker.

It runs on the worker's internal port, apart from the public OpenAI port, and every request carries
the shared token in ``TOKEN_HEADER``. KV events are numbered per worker ``epoch`` (a fresh random id
at each start): a receiver that sees a gap in ``seq`` or a new epoch asks for a snapshot.
Disaggregation reuses vLLM's ``kv_transfer_params`` field names.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "INTERNAL_PATHS",
    "LABEL_DEPLOYMENT",
    "LABEL_MANAGED_BY",
    "LABEL_ROLE",
    "MANAGED_BY",
    "REQUEST_ID_HEADER",
    "TOKEN_ENV",
    "TOKEN_HEADER",
    "WORKER_HEADER",
    "KVEvent",
    "KVEventBatch",
    "KVSnapshot",
    "KVTransferParams",
    "LoadReport",
    "Role",
    "TokenizerFiles",
    "WorkerInfo",
    "is_valid_request_id",
]

Role = Literal["unified", "prefill", "decode"]

TOKEN_HEADER = "X-Herd-Token"
"""Carries the shared internal token on every internal request."""
TOKEN_ENV = "HERD_INTERNAL_TOKEN"
"""The environment variable workers and the orchestrator read the shared internal token from when
no ``--internal-token`` is given. ``herd up``, the operator and the chart use it rather than a
command line: ``ps`` shows argv to every user, and a token starting with '-' would read as a flag."""
WORKER_HEADER = "X-Herd-Worker"
"""Names the worker that served a request, on the orchestrator's responses."""
REQUEST_ID_HEADER = "X-Request-Id"
"""A client's id for its request: the gateway passes it to the worker, which uses it for the
response's ``id`` and echoes it (making one up when the client sent none or an invalid one)."""
_MAX_REQUEST_ID_LEN = 128


def is_valid_request_id(value: str) -> bool:
    """Whether a client's ``X-Request-Id`` is used as given: 1-128 printable ASCII characters."""
    return 0 < len(value) <= _MAX_REQUEST_ID_LEN and value.isascii() and value.isprintable()


LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "herd"
LABEL_DEPLOYMENT = "herd.dev/deployment"
LABEL_ROLE = "herd.dev/role"


class _Paths(BaseModel):
    model_config = ConfigDict(frozen=True)
    info: str = "/internal/info"
    load: str = "/internal/load"
    kv_events: str = "/internal/kv/events"
    kv_snapshot: str = "/internal/kv/snapshot"
    prefill: str = "/internal/prefill"
    kv_blocks: str = "/internal/kv/blocks"
    kv_release: str = "/internal/kv/release"
    tokenizer: str = "/internal/tokenizer"


INTERNAL_PATHS = _Paths()


class WorkerInfo(BaseModel):
    """What a worker is: enough for the orchestrator to tokenize and hash as the worker does."""

    model: str
    role: Role
    block_size: int
    max_model_len: int
    epoch: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int | None = None
    """Token ids this model takes, ``[0, vocab_size)``; ``None`` from a worker too old to say."""
    embedding_size: int | None = None
    """An embedding model's vector size (it answers ``/v1/embeddings`` and no completions); ``None``
    for a model that generates."""
    is_normalized: bool = False
    """The embedding model's vectors have unit length (a cut one is renormalized)."""
    is_matryoshka: bool = False
    """The embedding model was trained to be cut short (``dimensions`` may ask for fewer values)."""
    matryoshka_dimensions: list[int] | None = None
    """The sizes a Matryoshka model may be cut to, when it lists them; ``None``: any size up to its own."""


class TokenizerFiles(BaseModel):
    """The worker's tokenizer files, for an orchestrator without the model folder (hf://, s3://, pvc://).

    ``files`` maps file names (``herd.api.prompt.TOKENIZER_FILES``) to their texts, exactly what the
    worker's own ``PromptRenderer`` was built from: ``PromptRenderer.from_files(files)`` on the other
    side renders and tokenizes token for token as the worker does.
    """

    files: dict[str, str]


class LoadReport(BaseModel):
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_prefill_tokens: int = Field(default=0, description="Uncached prompt tokens queued.")
    kv_usage: float = Field(default=0.0, ge=0.0, le=1.0)
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    is_draining: bool = False


class KVEvent(BaseModel):
    seq: int
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[int] = Field(default_factory=list)


class KVEventBatch(BaseModel):
    epoch: str
    events: list[KVEvent]


class KVSnapshot(BaseModel):
    """Every block hash the worker's prefix cache holds, as of event ``seq``."""

    epoch: str
    seq: int
    block_size: int
    block_hashes: list[int]


class KVTransferParams(BaseModel):
    """Disaggregation handoff, in vLLM's field names (``kv_transfer_params`` on a request)."""

    model_config = ConfigDict(extra="allow")
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_block_hashes: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    lease_seconds: float | None = None
    first_token_ids: list[int] | None = None
    """The first output token, sampled by the prefill worker with the request's own settings: a
    decode worker streams it at once and computes the second, instead of sampling the first again."""
    prompt_token_ids: list[int] | None = Field(default=None, min_length=1)
    """herd: the prompt's token ids as the orchestrator rendered and tokenized them, handed to the
    prefill and the decode worker so that neither renders the prompt again. A worker checks them
    against its vocabulary and its context length like any token ids a client sends."""
    prompt_block_hashes: list[int] | None = None
    """herd: ``herd.api.kv_hash.block_hashes`` of ``prompt_token_ids`` (the orchestrator's), which the
    prefill worker labels its lease with instead of hashing the prompt again."""
