"""The engine's prefix cache end to end: long shared prefixes, eviction and reuse, KV events, salts."""

from __future__ import annotations

from pathlib import Path

from support.engine import GREEDY, make_engine, random_prompts

from herd.api.kv_hash import block_hashes
from herd.api.protocol import KVEvent
from herd.worker.sampling_params import SamplingParams

SHORT = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def replay(events: list[KVEvent], known: set[int] | None = None) -> set[int]:
    """What a router's KV index holds after applying ``events`` in order."""
    held = set(known or ())
    for event in events:
        held = held | set(event.block_hashes) if event.kind == "stored" else held - set(event.block_hashes)
    return held


def test_shared_512_token_prefix_is_served_from_cache(tiny_llama: Path) -> None:
    [prefix, tail_a, tail_b] = random_prompts([512, 7, 9], vocab_size=384, seed=3)
    engine = make_engine(tiny_llama)
    [first] = engine.generate([prefix + tail_a], SHORT)
    [second] = engine.generate([prefix + tail_b], SHORT)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 496
    assert engine.stats.prefix_cache_hits >= 496
    assert engine.stats.prefix_cache_queries == len(prefix) * 2 + 16


def test_kv_events_agree_with_the_cache_and_the_router_hashes(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, num_blocks=12)
    prompts = random_prompts([40, 70, 33, 90, 50], vocab_size=384, seed=5)
    held: set[int] = set()
    last_seq = 0
    kinds: set[str] = set()
    for prompt in prompts:
        engine.generate([prompt], SHORT)
        events = engine.drain_kv_events()
        kinds |= {event.kind for event in events}
        assert [event.seq for event in events] == list(range(last_seq + 1, last_seq + 1 + len(events)))
        last_seq = events[-1].seq if events else last_seq
        held = replay(events, held)
        snapshot = engine.kv_snapshot()
        assert held == set(snapshot.block_hashes) == set(engine.block_manager.cached)
        assert (snapshot.seq, snapshot.epoch, snapshot.block_size) == (last_seq, engine.info.epoch, 16)
    assert set(block_hashes(prompts[-1], 16, model_id="test-model")) <= held
    assert kinds == {"stored", "removed"}


def test_evicted_blocks_are_reused_tail_first(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, num_blocks=8)
    old, new = random_prompts([64, 64], vocab_size=384, seed=9)
    engine.generate([old], SHORT)
    old_hashes = block_hashes(old, 16, model_id="test-model")
    tail_block = engine.block_manager.cached[old_hashes[3]]
    engine.drain_kv_events()
    engine.generate([new], SHORT)  # needs 5 of the 8 blocks: one cached block of `old` must go
    removed = [h for e in engine.drain_kv_events() if e.kind == "removed" for h in e.block_hashes]
    assert removed == [old_hashes[3]]
    assert engine.block_manager.blocks[tail_block].block_hash != old_hashes[3]
    [again] = engine.generate([old], SHORT)
    assert again.num_cached_tokens == 48
    assert engine.load_report().num_free_blocks == 8


def test_cache_salt_isolates_tenants(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama)
    [prompt] = random_prompts([80], vocab_size=384, seed=11)
    for request_id, salt in [("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a")]:
        engine.add_request(request_id, prompt, SHORT, cache_salt=salt)
        cached = None
        for _ in range(10):
            outputs = engine.step()
            cached = outputs[0].num_cached_tokens if outputs else cached
            if not engine.has_unfinished_requests():
                break
        assert cached == (64 if request_id == "c" else 0)


def test_disabled_prefix_cache_reports_no_hits(tiny_llama: Path) -> None:
    engine = make_engine(tiny_llama, kvCache={"prefixCaching": False})
    [prompt] = random_prompts([64], vocab_size=384)
    results = [engine.generate([prompt], GREEDY)[0] for _ in range(2)]
    assert [r.num_cached_tokens for r in results] == [0, 0]
    assert results[0].new_token_ids == results[1].new_token_ids
    assert engine.drain_kv_events() == []
