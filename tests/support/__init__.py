"""Helpers shared by the test suite (tiny models, servers, ports, processes)."""
