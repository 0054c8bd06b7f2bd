"""The Kubernetes connection layer shared by the operator and the orchestrator.

Both talk to the API server with plain REST over ``httpx``; this package finds the server and the
credentials (in-cluster service account, else a kubeconfig, through the ``kubernetes`` package's
loaders) and builds the client, so that the two components authenticate the same way. It imports
``herd.api`` at most; the components import it, never the reverse (an import-linter contract).
"""

from herd.kube._connection import Connection, CredentialsError, load_connection
from herd.kube._paths import resource_path

__all__ = ["Connection", "CredentialsError", "load_connection", "resource_path"]
