"""The worker's HTTP servers: the public OpenAI API and the internal protocol port."""

from herd.worker.server._internal import build_internal_app
from herd.worker.server._public import PublicOptions, build_public_app
from herd.worker.server._serve import ServeOptions, serve, serve_many

__all__ = ["PublicOptions", "ServeOptions", "build_internal_app", "build_public_app", "serve", "serve_many"]
