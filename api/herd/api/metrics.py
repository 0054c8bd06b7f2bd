"""Metric names. Worker metrics keep vLLM's names so existing dashboards and gateways work."""

from __future__ import annotations

__all__ = [
    "ORCHESTRATOR_METRICS",
    "WORKER_METRICS",
]

# Worker (vLLM-compatible names).
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
REQUEST_SUCCESS_TOTAL = "vllm:request_success_total"
SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
"""Counters (exposed with ``_total``), as vLLM names them; per position under the label ``position``."""
LORA_REQUESTS_INFO = "vllm:lora_requests_info"

# Worker (herd's own).
HERD_KV_EVENTS_TOTAL = "herd_kv_events_total"
HERD_KV_TRANSFER_BYTES_TOTAL = "herd_kv_transfer_bytes_total"
HERD_KV_TRANSFER_BLOCKS_TOTAL = "herd_kv_transfer_blocks_total"
HERD_KV_TRANSFER_SECONDS = "herd_kv_transfer_seconds"
HERD_KV_LEASES_EXPIRED_TOTAL = "herd_kv_leases_expired_total"
HERD_ENGINE_STEP_SECONDS = "herd_engine_step_seconds"
HERD_REQUESTS_REJECTED_TOTAL = "herd_requests_rejected_total"
HERD_KV_TIER_USAGE_PERC = "herd_kv_tier_usage_perc"
HERD_KV_TIER_BLOCKS = "herd_kv_tier_blocks"
HERD_KV_TIER_STORED_TOTAL = "herd_kv_tier_stored_blocks_total"
HERD_KV_TIER_RESTORED_TOTAL = "herd_kv_tier_restored_blocks_total"
HERD_KV_TIER_EVICTED_TOTAL = "herd_kv_tier_evicted_blocks_total"
HERD_KV_TIER_RESTORE_BYTES_PER_SECOND = "herd_kv_tier_restore_bytes_per_second"
HERD_PREFILL_TOKENS_PER_SECOND = "herd_prefill_tokens_per_second"
HERD_KV_PEER_PULLS_TOTAL = "herd_kv_peer_pulls_total"
"""Pulls of a prompt's blocks from a peer worker, by outcome: pulled, empty (the peer held none of
them any more) or failed (the blocks were computed instead)."""
HERD_KV_LEASES_TOTAL = "herd_kv_leases_total"
"""Leases a worker gave peers that asked to pull a prompt's blocks, by ``end``: why the run it held
stopped (whole, not_cached, on_disk, no_free_block, tier_failed); an empty lease is one that held none."""

# Every serving process (the orchestrator and each worker), herd's own.
HERD_GC_PAUSE_SECONDS = "herd_gc_pause_seconds"
"""The process's garbage collection pauses, by generation (``herd.api.heap``)."""

# Orchestrator.
HERD_ROUTER_REQUESTS_TOTAL = "herd_router_requests_total"
HERD_ROUTER_ERRORS_TOTAL = "herd_router_errors_total"
HERD_ROUTER_RETRIES_TOTAL = "herd_router_retries_total"
HERD_ROUTER_RESUMES_TOTAL = "herd_router_stream_resumes_total"
HERD_ROUTER_DECISION_SECONDS = "herd_router_decision_seconds"
HERD_ROUTER_TTFT_SECONDS = "herd_router_time_to_first_token_seconds"
HERD_ROUTER_E2E_SECONDS = "herd_router_e2e_request_latency_seconds"
HERD_ROUTER_IN_FLIGHT = "herd_router_requests_in_flight"
HERD_ROUTER_REQUESTS_HELD = "herd_router_requests_held"
"""Requests held for a model that has no ready worker (scaled to zero): the demand that starts one."""
HERD_ROUTER_WORKERS = "herd_router_workers"
HERD_ROUTER_CACHE_HIT_BLOCKS = "herd_router_predicted_cache_hit_blocks"
HERD_ROUTER_PHASE_SECONDS = "herd_router_phase_seconds"
HERD_ROUTER_CIRCUIT_STATE = "herd_router_circuit_state"
HERD_WORKER_RESTARTS_TOTAL = "herd_worker_restarts_total"

WORKER_METRICS = (
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    KV_CACHE_USAGE_PERC,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    TIME_TO_FIRST_TOKEN_SECONDS,
    INTER_TOKEN_LATENCY_SECONDS,
    E2E_REQUEST_LATENCY_SECONDS,
    PROMPT_TOKENS_TOTAL,
    GENERATION_TOKENS_TOTAL,
    CACHE_CONFIG_INFO,
    NUM_PREEMPTIONS_TOTAL,
    REQUEST_SUCCESS_TOTAL,
    SPEC_DECODE_NUM_DRAFTS,
    SPEC_DECODE_NUM_DRAFT_TOKENS,
    SPEC_DECODE_NUM_ACCEPTED_TOKENS,
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
    LORA_REQUESTS_INFO,
    HERD_KV_EVENTS_TOTAL,
    HERD_KV_TRANSFER_BYTES_TOTAL,
    HERD_KV_TRANSFER_BLOCKS_TOTAL,
    HERD_KV_TRANSFER_SECONDS,
    HERD_KV_LEASES_EXPIRED_TOTAL,
    HERD_ENGINE_STEP_SECONDS,
    HERD_REQUESTS_REJECTED_TOTAL,
    HERD_KV_TIER_USAGE_PERC,
    HERD_KV_TIER_BLOCKS,
    HERD_KV_TIER_STORED_TOTAL,
    HERD_KV_TIER_RESTORED_TOTAL,
    HERD_KV_TIER_EVICTED_TOTAL,
    HERD_KV_TIER_RESTORE_BYTES_PER_SECOND,
    HERD_PREFILL_TOKENS_PER_SECOND,
    HERD_KV_PEER_PULLS_TOTAL,
    HERD_KV_LEASES_TOTAL,
    HERD_GC_PAUSE_SECONDS,
)
ORCHESTRATOR_METRICS = (
    HERD_ROUTER_REQUESTS_TOTAL,
    HERD_ROUTER_ERRORS_TOTAL,
    HERD_ROUTER_RETRIES_TOTAL,
    HERD_ROUTER_RESUMES_TOTAL,
    HERD_ROUTER_DECISION_SECONDS,
    HERD_ROUTER_TTFT_SECONDS,
    HERD_ROUTER_E2E_SECONDS,
    HERD_ROUTER_IN_FLIGHT,
    HERD_ROUTER_REQUESTS_HELD,
    HERD_ROUTER_WORKERS,
    HERD_ROUTER_CACHE_HIT_BLOCKS,
    HERD_ROUTER_PHASE_SECONDS,
    HERD_ROUTER_CIRCUIT_STATE,
    HERD_WORKER_RESTARTS_TOTAL,
    HERD_GC_PAUSE_SECONDS,
)
