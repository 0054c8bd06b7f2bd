"""``herd epp``: herd's routing as a Gateway API Inference Extension Endpoint Picker (ext_proc gRPC)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from herd.api.logs import configure_logging
from herd.api.manifest import ManifestError
from herd.api.protocol import TOKEN_ENV
from herd.cli._args import port, positive
from herd.cli.orchestrator import (
    add_admission_arguments,
    add_source_arguments,
    idle_headroom,
    load_source,
    queue_settings,
)
from herd.orchestrator.auth import ApiKeys, load_api_keys
from herd.orchestrator.epp import EppSettings, PickerSettings, serve_epp
from herd.orchestrator.registry import RegistrySettings
from herd.orchestrator.routing.reserve import SlotReserve
from herd.orchestrator.state import build_state

__all__ = ["epp_settings", "register"]

DEFAULT_PORT = 9002
"""The port InferencePools name for their endpoint picker by default."""


def run(args: argparse.Namespace) -> int:
    try:
        source = load_source(args)
        api_keys = load_api_keys(args.api_keys_file)
    except (ManifestError, ValueError, OSError) as error:
        print(f"herd epp: {error}", file=sys.stderr)
        return 2
    configure_logging("epp", args.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health poll otherwise
    serving = serve_epp(
        source,
        host=args.host,
        port=args.port,
        state=build_state(args.redis, timeout_seconds=args.redis_timeout),
        settings=epp_settings(args, api_keys),
    )
    asyncio.run(serving)
    return 0


def epp_settings(args: argparse.Namespace, api_keys: ApiKeys | None) -> EppSettings:
    """The picker's settings from its flags: admission (the queue's bounds, the slot reserve, the idle
    headroom) as ``herd orchestrator`` reads the same flags."""
    return EppSettings(
        internal_token=args.internal_token or os.environ.get(TOKEN_ENV),
        registry=RegistrySettings(poll_interval=args.poll_interval),
        picker=PickerSettings(
            max_body_bytes=args.max_body_bytes,
            queue=queue_settings(args),
            slot_reserve=SlotReserve(share=args.slot_reserve),
            idle_headroom=idle_headroom(args),
        ),
        api_keys=api_keys,
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "epp", help="serve herd's routing to an Envoy-based gateway (Gateway API Inference Extension)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="the gRPC address (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=port, default=DEFAULT_PORT, help="ext_proc and gRPC health")
    add_source_arguments(parser)
    parser.add_argument("--max-body-bytes", type=positive(int), default=PickerSettings().max_body_bytes)
    add_admission_arguments(parser)
    parser.add_argument("--log-level", default="INFO")
    parser.set_defaults(func=run)
