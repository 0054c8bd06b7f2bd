"""herd.orchestrator."""
