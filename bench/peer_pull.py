"""Issue 20: a prompt whose prefix a peer worker caches, pulled from that peer against computed.

Two ``herd worker`` processes of SmolLM2-135M-Instruct (fp32, CPU, one torch thread each, the same
engine block) on loopback: a holder and a puller. For every measured request a fresh prefix of about
``--prefix-words`` words (unique from its first block, so neither worker has any of it cached) is
sent to the holder first (one token), so the holder's device caches it. Then the puller gets the
prefix plus a short question, one greedy token, either:

- ``pull``: with ``kv_transfer_params.peer_url`` naming the holder's internal address and the
  internal token, as the orchestrator sends it when kv_cache_aware chose a pull: the puller leases
  the blocks on the holder, fetches them over HTTP, imports them and prefills only the tail;
- ``compute``: the same request without it: the puller prefills the whole prompt.

The figure is the puller's time to answer (one token, so about its time to first token), measured by
the client. The two setups alternate within each round (order swapped every round) over ``--rounds``
rounds on the same two processes; the puller's ``herd_kv_peer_pulls_total{outcome="pulled"}`` is
checked to grow by one for every pull. The only difference between the setups is the handoff field.

    .venv/bin/python bench/peer_pull.py                   # writes bench/results/peer_pull.json
    .venv/bin/python bench/peer_pull.py --rounds 1 --per-round 1 --out /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import contextlib
import random
import secrets
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from _common import DEMO_MODEL, REPO, herd_workers, machine_info, write_json
from prometheus_client.parser import text_string_to_metric_families

from herd.api import metrics
from herd.api.protocol import TOKEN_HEADER

NAME = "smollm2"
ENGINE = {
    "device": "cpu",
    "dtype": "float32",
    "maxModelLen": 2048,
    "kvCache": {"blockSize": 16, "memoryGiB": 0.5},
}
WORDS = [
    "river",
    "stone",
    "cloud",
    "paper",
    "lamp",
    "garden",
    "window",
    "signal",
    "market",
    "harbor",
    "engine",
    "forest",
    "silver",
    "letter",
    "bridge",
    "winter",
    "orange",
    "planet",
    "circle",
    "station",
]
SETUPS = ("pull", "compute")


@contextlib.contextmanager
def workers(log_dir: Path, token: str) -> Iterator[dict[str, tuple[str, str]]]:
    """The holder and the puller, each ``(public URL, internal URL)``; stopped by pid on exit."""
    urls: dict[str, tuple[str, str]] = {}
    with contextlib.ExitStack() as stack:
        for role in ("holder", "puller"):
            log = log_dir / f"{role}.log"
            worker = herd_workers(DEMO_MODEL, name=NAME, token=token, engine=ENGINE, log=log)
            urls[role] = stack.enter_context(worker).urls[0]
        yield urls


def prefix(number: int, num_words: int) -> str:
    """A prefix no other request shares from its first block on."""
    rng = random.Random(number)
    return f"Document {number}. " + " ".join(rng.choice(WORDS) for _ in range(num_words))


def chat(text: str) -> dict[str, Any]:
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "temperature": 0,
        "ignore_eos": True,
    }


def ask(
    client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[float, dict[str, Any]]:
    """Seconds to the whole answer (one token) and its usage."""
    started = time.perf_counter()
    response = client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
    seconds = time.perf_counter() - started
    response.raise_for_status()
    usage: dict[str, Any] = response.json()["usage"]
    return seconds, usage


def pulled(client: httpx.Client, url: str) -> float:
    """The worker's pulls that brought blocks (``herd_kv_peer_pulls_total{outcome="pulled"}``)."""
    text = client.get(f"{url}/metrics").raise_for_status().text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == metrics.HERD_KV_PEER_PULLS_TOTAL and sample.labels.get("outcome") == "pulled"
    )


def one(
    client: httpx.Client,
    urls: dict[str, tuple[str, str]],
    setup: str,
    number: int,
    args: argparse.Namespace,
    token: str,
) -> dict[str, Any]:
    """One measured request of ``setup`` on a fresh prefix the holder caches first."""
    holder, holder_internal = urls["holder"]
    puller = urls["puller"][0]
    shared = prefix(number, args.prefix_words)
    ask(client, holder, chat(shared), {})
    body = chat(shared + " Which word comes first?")
    headers = {}
    if setup == "pull":
        body["kv_transfer_params"] = {"peer_url": holder_internal}
        headers = {TOKEN_HEADER: token}
    before = pulled(client, puller)
    seconds, usage = ask(client, puller, body, headers)
    num_pulls = pulled(client, puller) - before
    if num_pulls != (1 if setup == "pull" else 0):
        raise RuntimeError(f"{setup}: the puller counted {num_pulls} pulls; see its log")
    return {"setup": setup, "seconds": round(seconds, 4), "prompt_tokens": usage["prompt_tokens"]}


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = [sample["seconds"] * 1000 for sample in samples]
    return {
        "n": len(seconds),
        "median_ms": round(statistics.median(seconds), 1),
        "min_ms": round(min(seconds), 1),
        "max_ms": round(max(seconds), 1),
        "prompt_tokens": statistics.median(sample["prompt_tokens"] for sample in samples),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    token = secrets.token_urlsafe(16)
    samples: list[dict[str, Any]] = []
    with workers(Path(args.log_dir), token) as urls, httpx.Client(timeout=300) as client:
        for number in range(2):  # warm-up: the first requests load kernels and caches
            for setup in SETUPS:
                one(client, urls, setup, 900_000 + 2 * number + SETUPS.index(setup), args, token)
        for round_number in range(args.rounds):
            order = SETUPS if round_number % 2 == 0 else SETUPS[::-1]
            for index in range(args.per_round):
                for setup in order:
                    number = 1000 * round_number + 10 * index + SETUPS.index(setup)
                    sample = one(client, urls, setup, number, args, token)
                    samples.append({"round": round_number, **sample})
                    print(sample, file=sys.stderr)
    by_setup = {setup: summary([s for s in samples if s["setup"] == setup]) for setup in SETUPS}
    ratio = by_setup["compute"]["median_ms"] / by_setup["pull"]["median_ms"]
    return {
        "benchmark": "peer_pull",
        "command": " ".join(["bench/peer_pull.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "settings": {
            **{key: str(value) for key, value in vars(args).items()},
            "engine": ENGINE,
            "model": DEMO_MODEL.name,
        },
        "summary": by_setup,
        "compute_over_pull": round(ratio, 2),
        "samples": samples,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=2, help="measured requests per setup per round")
    parser.add_argument("--prefix-words", type=int, default=900, help="words of each shared prefix")
    parser.add_argument("--log-dir", default="/tmp/herd-peer-pull")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "peer_pull.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    write_json(args.out, result)
    for setup, figures in result["summary"].items():
        print(f"{setup:8} {figures}")
    print(f"compute / pull (median): {result['compute_over_pull']}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
