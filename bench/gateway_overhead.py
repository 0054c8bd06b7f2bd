"""Gateway overhead: latency added by the orchestrator versus calling a worker directly.

The upstream is a minimal fake worker (raw asyncio HTTP/1.1 on loopback, a fixed answer, no model)
so the figures measure the gateway alone. One run interleaves direct and gateway requests:
non-streaming full-response latency, and streaming time to the first body byte. The gateway's CPU
per request is reported as measured and without its background polling (health, load and KV feed
every 0.25 s), whose rate is measured first with no requests in flight.

    .venv/bin/python bench/gateway_overhead.py --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from support.procs import free_port, stop_process, wait_until  # noqa: E402

CHAT = {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
_JSON = b'{"id":"x","object":"chat.completion","model":"bench","choices":[],"usage":{}}'
_SSE = [b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'] * 4 + [b"data: [DONE]\n\n"]
_INTERNAL = {
    b"/internal/load": b'{"num_running":0,"num_waiting":0}',
    b"/internal/kv/events": b'{"epoch":"e","events":[]}',
    b"/internal/kv/snapshot": b'{"epoch":"e","seq":0,"block_size":16,"block_hashes":[]}',
}


async def _fake_worker_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        body = await reader.readexactly(length)
        path = head.split(b" ")[1]
        if path.startswith(b"/v1/") and (b'"stream": true' in body or b'"stream":true' in body):
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for chunk in _SSE:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            writer.write(b"0\r\n\r\n")
        else:
            answer = _INTERNAL.get(path.split(b"?")[0], _JSON)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(answer), answer)
            )
        await writer.drain()


async def _serve_fake_worker(port: int) -> None:
    server = await asyncio.start_server(_fake_worker_conn, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
    }


def _time_full(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    response = client.post(url, json=CHAT)
    response.read()
    return time.perf_counter() - started


def _time_first_byte(client: httpx.Client, url: str) -> float:
    started = time.perf_counter()
    with client.stream("POST", url, json={**CHAT, "stream": True}) as response:
        chunks = response.iter_raw()
        next(chunks)
        elapsed = time.perf_counter() - started
        for _ in chunks:
            pass
    return elapsed


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far (load-independent, unlike wall time)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu_ms_per_second(pid: int, seconds: float = 10.0) -> float:
    """The gateway's CPU with no request in flight: its registry polling the worker."""
    before = _cpu_seconds(pid)
    time.sleep(seconds)
    return (_cpu_seconds(pid) - before) / seconds * 1000


def measure(worker: str, gateway: str, pids: tuple[int, int], num_requests: int) -> dict[str, object]:
    """Interleaved direct and gateway timings; CPU per request of the gateway and, for scale, of the
    fake worker (which answers both the direct and the proxied request of each pair)."""
    gateway_pid, worker_pid = pids
    timers = {"non_streaming": _time_full, "streaming_first_byte": _time_first_byte}
    polling_ms_per_s = idle_cpu_ms_per_second(gateway_pid)
    results: dict[str, object] = {"gateway_idle_polling_cpu_ms_per_second": round(polling_ms_per_s, 3)}
    with httpx.Client() as client:
        for name, timer in timers.items():
            for _ in range(50):  # warm-up: connections, code paths
                timer(client, worker), timer(client, gateway)
            direct, through = [], []
            cpu_before = _cpu_seconds(gateway_pid), _cpu_seconds(worker_pid)
            started = time.perf_counter()
            for _ in range(num_requests):
                direct.append(timer(client, worker))
                through.append(timer(client, gateway))
            polling_ms = polling_ms_per_s * (time.perf_counter() - started)
            gateway_ms = (_cpu_seconds(gateway_pid) - cpu_before[0]) * 1000
            worker_ms = (_cpu_seconds(worker_pid) - cpu_before[1]) / (2 * num_requests) * 1000
            results[name] = {
                **_summary(direct, through),
                "gateway_cpu_ms_per_request": round(gateway_ms / num_requests, 3),
                "gateway_cpu_ms_per_request_without_polling": round(
                    (gateway_ms - polling_ms) / num_requests, 3
                ),
                "fake_worker_cpu_ms_per_request": round(worker_ms, 3),
            }
    return results


def _summary(direct: list[float], through: list[float]) -> dict[str, object]:
    added = [g - d for d, g in zip(direct, through, strict=True)]
    return {"direct": _percentiles(direct), "gateway": _percentiles(through), "added": _percentiles(added)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--fake-worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gateway_overhead.json")
    args = parser.parse_args()
    if args.fake_worker is not None:
        asyncio.run(_serve_fake_worker(args.fake_worker))
        return 0
    started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_before = os.getloadavg()[0]
    worker_port, gateway_port = free_port(), free_port()
    workdir = Path(tempfile.mkdtemp(prefix="herd-bench-"))
    manifest = workdir / "bench.yaml"
    manifest.write_text(
        "apiVersion: herd.dev/v1alpha1\nkind: ModelDeployment\nmetadata: {name: bench}\n"
        "spec: {model: {source: 'file:///nonexistent'}, routing: {strategy: round_robin}}\n"
    )
    worker_url = f"http://127.0.0.1:{worker_port}"
    fake = subprocess.Popen([sys.executable, __file__, "--fake-worker", str(worker_port)])
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "herd.cli.main",
            "orchestrator",
            "--port",
            str(gateway_port),
            "--manifest",
            str(manifest),
            "--worker",
            f"{worker_url},{worker_url}",
            "--log-level",
            "WARNING",
        ]
    )
    try:
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{gateway_port}/ready").status_code == 200,
            timeout=90,
            what="gateway ready",
        )
        results = measure(
            f"{worker_url}/v1/chat/completions",
            f"http://127.0.0.1:{gateway_port}/v1/chat/completions",
            (gateway.pid, fake.pid),
            args.requests,
        )
    finally:
        stop_process(gateway)
        stop_process(fake)
    report = {
        "requests_per_case": args.requests,
        "started_utc": started_utc,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_1m_before": load_before,
        "load_average_1m": os.getloadavg()[0],
        "upstream": "fake loopback worker (raw asyncio HTTP/1.1, no model)",
        **results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
