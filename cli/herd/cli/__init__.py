"""herd.cli."""
