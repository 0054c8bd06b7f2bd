"""herd as a Gateway API Inference Extension Endpoint Picker (``herd epp``).

An Envoy-based gateway (Envoy Gateway, kgateway, Istio, GKE) asks the endpoint picker which model
server should take each request, over Envoy's external processing protocol (ext_proc, gRPC). herd
answers with the same preparation, the same ``decide`` and the same ``Registry.hold`` as its own
gateway: ``picker`` is the edge (no gRPC types), ``wire`` the Endpoint Picker protocol's messages
(pure), ``exchange`` one HTTP request's ext_proc stream, and ``server`` the gRPC server with its
health services. See docs/gateway-api.md.
"""

from herd.orchestrator.epp.picker import Picker, PickerSettings
from herd.orchestrator.epp.server import EppSettings, build_epp, serve_epp

__all__ = ["EppSettings", "Picker", "PickerSettings", "build_epp", "serve_epp"]
