"""The internal worker protocol: what the orchestrator and peer workers exchange with a worker.

It runs on the worker's internal port, apart from the public OpenAI port, and every request carries
the shared token in ``TOKEN_HEADER``. KV events are numbered per worker ``epoch`` (a fresh random id
at each start): a receiver that sees a gap in ``seq`` or a new epoch asks for a snapshot.
Disaggregation reuses vLLM's ``kv_transfer_params`` field names.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "INTERNAL_PATHS",
    "LABEL_DEPLOYMENT",
    "LABEL_MANAGED_BY",
    "LABEL_ROLE",
    "MANAGED_BY",
    "MAX_LOAD_COUNT",
    "MAX_LOAD_RATE",
    "MEDIA",
    "RENDEZVOUS_PORT",
    "REQUEST_ID_HEADER",
    "TOKEN_ENV",
    "TOKEN_HEADER",
    "WORKER_HEADER",
    "KVEvent",
    "KVEventBatch",
    "KVSnapshot",
    "KVTransferParams",
    "LoadReport",
    "Medium",
    "Role",
    "StatusQuery",
    "TokenizerFiles",
    "WorkerInfo",
    "WorkerStatus",
    "is_valid_request_id",
]

Role = Literal["unified", "prefill", "decode"]
Medium = Literal["device", "host", "disk"]
"""Where a KV block lives: the accelerator's pool, the host-memory tier, or the local disk tier
(vLLM's KV events call the same field ``medium``: its ``GPU`` is herd's ``device``, ``CPU`` is ``host``)."""
MEDIA: tuple[Medium, ...] = ("device", "host", "disk")
"""Every medium, fastest first."""

TOKEN_HEADER = "X-Herd-Token"
"""Carries the shared internal token on every internal request."""
TOKEN_ENV = "HERD_INTERNAL_TOKEN"
"""The environment variable workers and the orchestrator read the shared internal token from when
no ``--internal-token`` is given. ``herd up``, the operator and the chart use it rather than a
command line: ``ps`` shows argv to every user, and a token starting with '-' would read as a flag."""
RENDEZVOUS_PORT = 29500
"""The leader pod's tensor-parallel rendezvous port when a model spans several pods: its ranks' store
(torch.distributed's usual port); the follower pods' ranks dial it at the leader's address."""
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
    kv_hold: str = "/internal/kv/hold"
    kv_probe: str = "/internal/kv/probe"
    tokenizer: str = "/internal/tokenizer"
    status: str = "/internal/status"


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


MAX_LOAD_COUNT = 2**53
"""Above any count or size a worker reports, and what a float holds exactly."""
MAX_LOAD_RATE = 1e15
"""Above any rate (tokens or bytes a second) or seconds a worker measures."""


class LoadReport(BaseModel):
    """A worker's load as of its last step. The LoRA fields follow the Gateway API Inference
    Extension's ``vllm:lora_requests_info``: adapters loaded, running and waiting, and ``max_loras``,
    the distinct adapters one step may run (0: LoRA is off).

    Routing prices workers by these figures, so a report with a negative count or a rate that is not
    a finite positive number, or one past any real machine's (``MAX_LOAD_COUNT``, ``MAX_LOAD_RATE``: products
    of them stay finite floats), is refused where it enters (the orchestrator counts it as the
    worker's failure), never ranked."""

    model_config = ConfigDict(allow_inf_nan=False)

    num_running: int = Field(default=0, ge=0, le=MAX_LOAD_COUNT)
    num_waiting: int = Field(default=0, ge=0, le=MAX_LOAD_COUNT)
    num_waiting_prefill_tokens: int = Field(
        default=0, ge=0, le=MAX_LOAD_COUNT, description="Uncached prompt tokens queued."
    )
    kv_usage: float = Field(default=0.0, ge=0.0, le=1.0)
    num_free_blocks: int = Field(default=0, ge=0, le=MAX_LOAD_COUNT)
    num_total_blocks: int = Field(default=0, ge=0, le=MAX_LOAD_COUNT)
    is_draining: bool = False
    bytes_per_block: int = Field(
        default=0, ge=0, le=MAX_LOAD_COUNT, description="One KV block's size; 0 if not reported."
    )
    max_batch_tokens: int = Field(
        default=0,
        ge=0,
        le=MAX_LOAD_COUNT,
        description="Prompt tokens one engine step computes at most; 0 if not reported.",
    )
    prefill_tokens_per_s: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_LOAD_RATE,
        description="Measured prefill rate (tokens a second); None until measured.",
    )
    decode_step_s: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_LOAD_RATE,
        description=(
            "Measured seconds of a step that prefills too little to time a rate (decodes); "
            "None until measured."
        ),
    )
    restore_bytes_per_s: dict[Medium, Annotated[float, Field(gt=0.0, le=MAX_LOAD_RATE)]] = Field(
        default_factory=dict,
        description="Measured bandwidth of restoring blocks onto the device, per tier it restores from.",
    )
    pull_bytes_per_s: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_LOAD_RATE,
        description="Measured bandwidth of pulling blocks from a peer worker.",
    )
    max_loras: int = Field(default=0, ge=0, le=MAX_LOAD_COUNT)
    lora_adapters: list[str] = Field(default_factory=list, description="LoRA adapters loaded.")
    running_lora_adapters: list[str] = Field(default_factory=list)
    waiting_lora_adapters: list[str] = Field(default_factory=list)


class KVEvent(BaseModel):
    """Blocks entering (``stored``) or leaving (``removed``) one tier, ``medium``, of a worker's cache;
    ``cleared`` empties every tier. A block may sit in several tiers at once (a restored block keeps
    its host copy), so each tier's holdings are tracked apart."""

    seq: int
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[int] = Field(default_factory=list)
    medium: Medium = "device"


class KVEventBatch(BaseModel):
    epoch: str
    events: list[KVEvent]


class KVSnapshot(BaseModel):
    """Every block hash the worker's prefix cache holds, as of event ``seq``."""

    epoch: str
    seq: int
    block_size: int
    block_hashes: list[int]
    tier_block_hashes: dict[Medium, list[int]] = Field(default_factory=dict)
    """The blocks each tier below the device holds (``host``, ``disk``); ``block_hashes`` is the device's."""

    @field_validator("tier_block_hashes")
    @classmethod
    def _check_lower_tiers(cls, value: dict[Medium, list[int]]) -> dict[Medium, list[int]]:
        if "device" in value:
            raise ValueError(
                "tier_block_hashes lists the tiers below the device; the device's are block_hashes"
            )
        return value


class StatusQuery(BaseModel):
    """The status stream's query parameters (see ``WorkerStatus``), with their bounds."""

    epoch: str | None = Field(default=None, description="The epoch the receiver's `after` belongs to.")
    after: int = Field(default=-1, description="The last KV event seq the receiver holds; -1: none.")
    interval: float = Field(default=0.25, ge=0.01, le=3600.0, description="Least seconds between lines.")
    heartbeat: float = Field(default=1.0, ge=0.05, le=3600.0, description="Most seconds between lines.")


class WorkerStatus(BaseModel):
    """One line of a worker's status stream (``GET INTERNAL_PATHS.status``, newline-delimited JSON).

    The orchestrator holds one such stream open per worker instead of polling readiness, load and KV
    events separately. Query parameters: ``epoch`` and ``after`` (the receiver's KV position: the
    stream starts with the events after ``after`` when ``epoch`` is the worker's, else with a
    snapshot), ``interval`` (at most one line per ``interval`` seconds while the load or the cache
    changes) and ``heartbeat`` (a line at least every ``heartbeat`` seconds even when nothing does, so
    that a silent stream means a stalled worker). A line carries a snapshot whenever the worker's epoch
    changes under the stream (its engine restarted); ``events`` continue from the last line's.
    """

    epoch: str
    is_ready: bool
    """What the public port's ``/ready`` says: the worker takes requests."""
    load: LoadReport = Field(default_factory=LoadReport)
    events: list[KVEvent] = Field(default_factory=list)
    snapshot: KVSnapshot | None = None


class KVTransferParams(BaseModel):
    """Disaggregation handoff, in vLLM's field names (``kv_transfer_params`` on a request)."""

    model_config = ConfigDict(extra="allow")
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None
    remote_block_hashes: list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = Field(default=None, ge=1, le=65535)
    remote_request_id: str | None = None
    lease_seconds: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
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
    peer_url: str | None = None
    """herd: the internal address of a peer worker whose device holds a leading run of the prompt's
    blocks that this worker lacks: pull them from it before prefilling (the orchestrator's routing
    decision, when measured cheaper than computing them); a failed pull computes them instead."""
