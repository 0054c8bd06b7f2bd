"""herd.operator."""
