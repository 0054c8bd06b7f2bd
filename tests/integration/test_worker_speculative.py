"""A ``herd worker`` process speculating with a draft model: the manifest's engine block loads the
draft from its folder, a request gets the tokens the plain engine gives, and ``/metrics`` counts
the drafts under vLLM's ``spec_decode`` names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from support.engine import make_engine, random_prompts
from support.worker_server import metric_value, worker_process

from herd.worker.sampling_params import SamplingParams

TOKEN = "spec-token"


def test_a_worker_speculates_with_its_draft_and_counts_it(tiny_llama: Path, tmp_path: Path) -> None:
    [passage] = random_prompts([30], vocab_size=384, seed=4)
    prompt = passage + passage[:15]
    plain = make_engine(tiny_llama).generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
    engine = {"speculative": {"method": "draft", "draftModel": f"file://{tiny_llama}", "numTokens": 3}}
    with worker_process(
        tiny_llama, log=tmp_path / "worker.log", token=TOKEN, engine_json=json.dumps(engine)
    ) as worker:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "return_token_ids": True,
        }
        answer = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60).json()
        text = httpx.get(f"{worker.url}/metrics", timeout=10).text
    assert answer["choices"][0]["text"] == plain.new_text
    drafts = metric_value(text, "vllm:spec_decode_num_drafts_total")
    proposed = metric_value(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= proposed <= 3 * drafts
    per_pos = {
        int(position): float(value)
        for position, value in re.findall(
            r'vllm:spec_decode_num_accepted_tokens_per_pos_total\{model_name="tiny",position="(\d)"\} (\S+)',
            text,
        )
    }
    assert sorted(per_pos) == [0, 1, 2]
    assert sum(per_pos.values()) == accepted
