"""The ``herd bench`` load generator: workloads, the streaming client, the run loop, statistics."""

from herd.cli.loadgen.client import RequestResult
from herd.cli.loadgen.config import BenchConfig
from herd.cli.loadgen.progress import Progress
from herd.cli.loadgen.report import format_table
from herd.cli.loadgen.runner import run_benchmark

__all__ = ["BenchConfig", "Progress", "RequestResult", "format_table", "run_benchmark"]
