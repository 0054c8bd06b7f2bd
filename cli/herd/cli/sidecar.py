"""``herd sidecar``: herd's worker contract in front of a vLLM server (the vLLM backend's pods)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from herd.api.backends import KV_EVENTS_TOPIC
from herd.api.logs import configure_logging
from herd.api.protocol import TOKEN_ENV
from herd.cli._args import port, positive

__all__ = ["register"]


def run(args: argparse.Namespace) -> int:
    from herd.sidecar import SidecarOptions, serve

    token = args.internal_token or os.environ.get(TOKEN_ENV, "")
    if not token:
        print(
            f"herd sidecar: pass --internal-token or set {TOKEN_ENV} (the orchestrator sends it)",
            file=sys.stderr,
        )
        return 2
    if args.role != "unified":
        print(
            f"herd sidecar: role {args.role!r} is not supported on vLLM: herd's disaggregated serving "
            "(prefill and decode pools) needs herd's own engine; serve this model aggregated "
            "(spec.serving.mode: aggregated) or with engine.backend: herd",
            file=sys.stderr,
        )
        return 2
    options = SidecarOptions(
        vllm_url=args.vllm_url,
        kv_events=args.kv_events,
        kv_replay=args.kv_replay,
        served_name=args.served_name,
        model_path=args.model,
        block_size=args.block_size,
        internal_token=token,
        host=args.host,
        port=args.port,
        internal_port=args.internal_port or args.port + 1000,
        kv_topic=args.kv_topic,
    )
    configure_logging("sidecar", args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    return serve(options)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("sidecar", help="serve herd's worker contract in front of a vLLM server")
    parser.add_argument("--vllm-url", required=True, help="the vLLM server's URL (http://127.0.0.1:PORT)")
    parser.add_argument(
        "--kv-events", required=True, help="ZMQ endpoint to bind for vLLM's KV events (tcp://127.0.0.1:PORT)"
    )
    parser.add_argument(
        "--kv-replay", required=True, help="vLLM's KV event replay endpoint (tcp://127.0.0.1:PORT)"
    )
    parser.add_argument(
        "--kv-topic", default=KV_EVENTS_TOPIC, help=f"vLLM's KV event topic (default {KV_EVENTS_TOPIC})"
    )
    parser.add_argument("--served-name", required=True, help="the OpenAI model name vLLM serves")
    parser.add_argument("--model", type=Path, required=True, help="the HF-format model folder vLLM serves")
    parser.add_argument("--block-size", type=positive(int), required=True, help="vLLM's --block-size")
    parser.add_argument("--role", choices=["unified", "prefill", "decode"], default="unified")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8001, help="public OpenAI port (default 8001)")
    parser.add_argument("--internal-port", type=port, help="internal protocol port (default: port + 1000)")
    parser.add_argument("--internal-token", help=f"shared internal token (default: ${TOKEN_ENV})")
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=run)
