"""``/v1/embeddings``: every input becomes one prefill-only request of the engine, batched by its
scheduler with whatever else is queued, and comes back as its pooled vector.

Inputs are validated where they enter, each 400 naming its field: ``input`` (text or ids, each
within the vocabulary and at most the model's length), ``dimensions`` (only on a model trained to be
cut short, and never beyond its size), and the model itself (a generation model embeds nothing).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence

import numpy as np

from herd.api.errors import HttpError
from herd.api.openai import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from herd.api.prompt import PromptRenderer
from herd.api.protocol import WorkerInfo
from herd.worker.engine_protocol import ServingEngine
from herd.worker.outputs import RequestOutput
from herd.worker.pooling import truncate
from herd.worker.sampling_params import SamplingParams
from herd.worker.server._params import prompt_errors

__all__ = [
    "check_dimensions",
    "check_embeds",
    "check_generates",
    "embed",
    "embedding_inputs",
    "encode_vector",
]

EMBEDDING_PARAMS = SamplingParams(max_tokens=1)
"""What the engine takes with an embedding request: it samples nothing, so nothing here is used."""


def check_embeds(info: WorkerInfo) -> int:
    """The model's vector size; 400 naming ``model`` when it generates instead."""
    if info.embedding_size is None:
        raise HttpError(
            400,
            f"model {info.model!r} is a generation model and serves no embeddings: send it "
            "/v1/chat/completions or /v1/completions, and embeddings to an embedding model",
            param="model",
        )
    return info.embedding_size


def check_generates(info: WorkerInfo) -> None:
    """400 naming ``model`` when the model only embeds."""
    if info.embedding_size is not None:
        raise HttpError(
            400,
            f"model {info.model!r} is an embedding model: it answers /v1/embeddings only",
            param="model",
        )


def check_dimensions(dimensions: int | None, info: WorkerInfo) -> int | None:
    """The size to cut vectors to (None: the model's own); 400 naming ``dimensions`` otherwise."""
    size = check_embeds(info)
    if dimensions is None or dimensions == size:
        return None
    if not info.is_matryoshka:
        raise HttpError(
            400,
            f"model {info.model!r} was not trained to be cut short (Matryoshka), so its {size}-value "
            "vectors cannot take dimensions; leave dimensions out",
            param="dimensions",
        )
    allowed = info.matryoshka_dimensions
    if dimensions > size or (allowed is not None and dimensions not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed is not None else f"1 to {size}"
        raise HttpError(
            400,
            f"dimensions {dimensions} is not a size this model offers: ask for {sizes}",
            param="dimensions",
        )
    return dimensions


def embedding_inputs(
    renderer: PromptRenderer, request: EmbeddingRequest, info: WorkerInfo
) -> list[list[int]]:
    """One token list per input (text tokenized with the model's special tokens, ids checked against
    the vocabulary), each at most ``info.max_model_len`` tokens."""
    with prompt_errors("input"):
        inputs = renderer.prompt_ids(request.input, param="input")
    for index, token_ids in enumerate(inputs):
        if len(token_ids) > info.max_model_len:
            where = "input" if len(inputs) == 1 else f"input[{index}]"
            raise HttpError(
                400,
                f"{where} has {len(token_ids)} tokens but this model embeds at most {info.max_model_len}; "
                "shorten it or split it",
                param="input",
            )
    return inputs


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or as base64 of its little-endian float32 bytes (what the openai SDK
    decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def embed(
    engine: ServingEngine,
    request_id: str,
    request: EmbeddingRequest,
    inputs: Sequence[list[int]],
    *,
    dimensions: int | None,
    served_name: str,
) -> EmbeddingResponse:
    """Every input through the engine at once (one failure cancels the rest and is raised)."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(_embed_one(engine, f"{request_id}-{index}", token_ids))
                for index, token_ids in enumerate(inputs)
            ]
    except ExceptionGroup as errors:
        raise errors.exceptions[0] from None
    data = []
    for index, task in enumerate(tasks):
        vector = task.result().embedding or []
        if dimensions is not None:
            vector = truncate(vector, dimensions, normalize=engine.info.is_normalized)
        data.append(EmbeddingData(index=index, embedding=encode_vector(vector, request.encoding_format)))
    num_tokens = sum(len(token_ids) for token_ids in inputs)
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    return EmbeddingResponse(data=data, model=served_name, usage=usage)


async def _embed_one(engine: ServingEngine, request_id: str, token_ids: list[int]) -> RequestOutput:
    last: RequestOutput | None = None
    async for output in engine.generate(request_id, token_ids, EMBEDDING_PARAMS):
        last = output
    if last is None or last.embedding is None:
        raise RuntimeError(f"the engine finished {request_id} without an embedding")
    return last
