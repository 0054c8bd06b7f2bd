"""The live dashboard: one self-contained HTML page (no external assets) polling ``/dashboard/data``."""

from __future__ import annotations

from typing import Any

from herd.orchestrator.registry import Registry, WorkerState
from herd.orchestrator.telemetry import Telemetry

__all__ = ["DASHBOARD_HTML", "dashboard_data"]


def dashboard_data(registry: Registry, telemetry: Telemetry) -> dict[str, Any]:
    """Workers with health, load, in-flight and KV blocks; request rate and TTFT over a short window."""
    ttft = telemetry.recent.ttft_p50_ms()
    return {
        "models": sorted(registry.models),
        "request_rate_per_s": round(telemetry.recent.rate_per_second(), 3),
        "ttft_p50_ms": None if ttft is None else round(ttft, 1),
        "workers": [_worker_row(registry, worker) for worker in registry.workers.values()],
    }


def _worker_row(registry: Registry, worker: WorkerState) -> dict[str, Any]:
    endpoint, report = worker.endpoint, worker.report
    served = registry.models.get(endpoint.model)
    return {
        "id": endpoint.id,
        "model": endpoint.model,
        "role": endpoint.role,
        "url": endpoint.url,
        "healthy": worker.is_healthy,
        "in_flight": worker.num_in_flight,
        "running": report.num_running,
        "waiting": report.num_waiting,
        "kv_usage": round(report.kv_usage, 4),
        "kv_blocks_used": report.num_total_blocks - report.num_free_blocks,
        "kv_blocks_total": report.num_total_blocks,
        "kv_blocks_indexed": 0 if served is None else served.kv_index.num_blocks(endpoint.id),
        "kv_position": None if served is None else served.kv_index.position(endpoint.id),
    }


DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>herd dashboard</title>
<style>
body{font:14px system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin-top:1em}
td,th{padding:.3em .8em;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}
.up{color:#080}.down{color:#b00}
</style></head><body>
<h1>herd</h1>
<p id="summary">loading...</p>
<table><thead><tr><th>worker</th><th>model</th><th>role</th><th>health</th><th>in flight</th>
<th>running</th><th>waiting</th><th>KV usage</th><th>KV blocks</th></tr></thead>
<tbody id="workers"></tbody></table>
<script>
function cell(text, cls){const td=document.createElement("td");td.textContent=text;if(cls)td.className=cls;return td;}
async function refresh(){
  try{
    const data=await (await fetch("dashboard/data")).json();
    const ttft=data.ttft_p50_ms===null?"-":data.ttft_p50_ms+" ms";
    document.getElementById("summary").textContent=
      "models: "+data.models.join(", ")+" | requests/s: "+data.request_rate_per_s+" | TTFT p50: "+ttft;
    const body=document.getElementById("workers");body.replaceChildren();
    for(const w of data.workers){
      const tr=document.createElement("tr");
      tr.append(cell(w.id),cell(w.model),cell(w.role),cell(w.healthy?"up":"down",w.healthy?"up":"down"),
        cell(w.in_flight),cell(w.running),cell(w.waiting),cell((w.kv_usage*100).toFixed(1)+"%"),
        cell(w.kv_blocks_used+"/"+w.kv_blocks_total));
      body.append(tr);
    }
  }catch(e){document.getElementById("summary").textContent="orchestrator unreachable: "+e;}
}
refresh();setInterval(refresh,1000);
</script></body></html>
"""
