"""herd.worker."""
