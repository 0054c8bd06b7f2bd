"""The live dashboard: one self-contained HTML page (no external assets) polling ``/dashboard/data``."""

from __future__ import annotations

import time
from typing import Any

from herd.orchestrator.breaker import BreakerState
from herd.orchestrator.history_sampler import HistorySampler, counter_totals
from herd.orchestrator.registry import Registry, WorkerState

__all__ = ["DASHBOARD_HTML", "dashboard_data"]


def dashboard_data(
    registry: Registry, sampler: HistorySampler, *, since: float | None = None
) -> dict[str, Any]:
    """Workers with health, circuit breaker, restarts, load, requests and KV blocks; totals, request
    rate and TTFT over a window; the history's points newer than ``since`` (Unix seconds), all without."""
    telemetry = sampler.telemetry
    ttft = telemetry.recent.ttft_p50_ms()
    requests_by_worker = counter_totals(telemetry.requests, "worker")
    now = time.monotonic()
    return {
        "models": sorted(registry.models),
        "requests_total": int(sum(requests_by_worker.values())),
        "errors_total": int(sum(counter_totals(telemetry.errors, "reason").values())),
        "window_seconds": telemetry.recent.window_seconds,
        "request_rate_per_s": round(telemetry.recent.rate_per_second(), 3),
        "ttft_p50_ms": None if ttft is None else round(ttft, 1),
        "workers": [
            _worker_row(registry, worker, int(requests_by_worker.get((worker.endpoint.id,), 0)), now)
            for worker in sorted(registry.workers.values(), key=lambda worker: worker.endpoint.id)
        ],
        "history": _history(sampler, since),
    }


def _history(sampler: HistorySampler, since: float | None) -> dict[str, Any]:
    settings = sampler.settings
    return {
        "interval_seconds": settings.interval_seconds,
        "window_seconds": settings.window_seconds,
        "span_seconds": settings.span_seconds,
        "points": [point.as_dict() for point in sampler.history.since(since)],
    }


def _worker_row(registry: Registry, worker: WorkerState, num_requests: int, now: float) -> dict[str, Any]:
    endpoint, report, circuit = worker.endpoint, worker.report, worker.breaker.state(now)
    served = registry.models.get(endpoint.model)
    return {
        "id": endpoint.id,
        "model": endpoint.model,
        "role": endpoint.role,
        "url": endpoint.url,
        "healthy": worker.is_healthy,
        "state": _state(worker, circuit),
        "circuit": circuit,
        "consecutive_failures": worker.breaker.num_failures,
        "restarts": worker.num_restarts,
        "requests_total": num_requests,
        "in_flight": worker.num_in_flight,
        "running": report.num_running,
        "waiting": report.num_waiting,
        "kv_usage": round(report.kv_usage, 4),
        "kv_blocks_used": report.num_total_blocks - report.num_free_blocks,
        "kv_blocks_total": report.num_total_blocks,
        "kv_blocks_indexed": 0 if served is None else served.kv_index.num_blocks(endpoint.id),
        "kv_position": None if served is None else served.kv_index.position(endpoint.id),
    }


def _state(worker: WorkerState, circuit: BreakerState) -> str:
    if not worker.is_healthy:
        return "down"
    if worker.report.is_draining:
        return "draining"
    return "up" if circuit == "closed" else "ejected"


DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width,initial-scale=1">
<title>herd dashboard</title>
<style>
:root{--fg:#1b1f24;--muted:#5a6472;--line:#d9dee5;--card:#f5f7fa;--bg:#fff;
  --up:#1a7f37;--up-bg:#dafbe1;--down:#b42318;--down-bg:#fee4e2;--warn:#8a5a00;--warn-bg:#fff4ce;
  --bar:#2f6fde;--bar-high:#e08600;--bar-bg:#e3e8ef}
@media (prefers-color-scheme:dark){:root{--fg:#e6edf3;--muted:#9aa6b2;--line:#30363d;--card:#161b22;
  --bg:#0d1117;--up:#4ac26b;--up-bg:#12361f;--down:#ff7b72;--down-bg:#3d1514;--warn:#e3b341;
  --warn-bg:#3a2a05;--bar:#58a6ff;--bar-high:#d29922;--bar-bg:#21262d}}
*{box-sizing:border-box}
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;padding:24px 32px;
  color:var(--fg);background:var(--bg)}
header{display:flex;align-items:baseline;gap:16px;flex-wrap:wrap}
h1{font-size:22px;margin:0}
.muted{color:var(--muted)}
#status.stale{color:var(--down);font-weight:600}
.cards{display:grid;grid-template-columns:repeat(auto-fit,minmax(130px,1fr));gap:12px;margin:18px 0}
.card{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px 14px}
.card .label{color:var(--muted);font-size:12px;text-transform:uppercase;letter-spacing:.04em}
.card .value{font-size:24px;font-weight:600;font-variant-numeric:tabular-nums;margin-top:2px}
.card .value.bad{color:var(--down)}
.card .value.none{font-size:16px;font-weight:400;color:var(--muted);padding:5px 0}
.scroll{overflow-x:auto}
table{border-collapse:collapse;width:100%}
th,td{padding:8px 10px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
th[title]{cursor:help}
th{font-size:12px;color:var(--muted);font-weight:600;text-transform:uppercase;letter-spacing:.04em}
td{font-variant-numeric:tabular-nums}
th.text,td.text{text-align:left}
td .sub{display:block;font-size:12px;color:var(--muted)}
.pill{display:inline-block;min-width:64px;text-align:center;padding:1px 8px;border-radius:999px;
  font-size:12px;font-weight:600}
.pill.up{color:var(--up);background:var(--up-bg)}
.pill.down{color:var(--down);background:var(--down-bg)}
.pill.draining{color:var(--warn);background:var(--warn-bg)}
.pill.ejected{color:var(--down);background:var(--down-bg)}
.meter{display:inline-block;vertical-align:middle;width:90px;height:8px;border-radius:4px;
  background:var(--bar-bg);margin-right:8px;overflow:hidden}
.meter span{display:block;height:100%;background:var(--bar)}
.meter.high span{background:var(--bar-high)}
tr.down td{color:var(--muted)}
td.empty{text-align:center;color:var(--muted);padding:24px}
h2{font-size:17px;margin:28px 0 4px}
h3{font-size:15px;margin:16px 0 8px}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(330px,1fr));gap:12px}
figure.chart{margin:0;background:var(--card);border:1px solid var(--line);border-radius:8px;padding:8px 10px}
figure.chart figcaption{font-size:12px;color:var(--muted);font-weight:600;text-transform:uppercase;
  letter-spacing:.04em}
figure.chart svg{display:block;width:100%;height:auto}
svg .axis{stroke:var(--line);stroke-width:1}
svg text{fill:var(--muted);font-size:10px;font-variant-numeric:tabular-nums}
svg path{fill:none;stroke-width:1.6;stroke-linejoin:round}
.legend{display:flex;flex-wrap:wrap;gap:2px 12px;font-size:12px;font-variant-numeric:tabular-nums}
.legend .swatch{display:inline-block;width:10px;height:3px;margin-right:4px;vertical-align:middle}
</style></head><body>
<header><h1>herd</h1><span class="muted">orchestrator dashboard</span>
<span id="status" class="muted">loading&hellip;</span></header>
<section class="cards">
<div class="card"><div class="label">Workers up</div><div class="value" data-summary="workers">-</div></div>
<div class="card"><div class="label">Requests</div><div class="value" data-summary="requests_total">-</div></div>
<div class="card"><div class="label">Errors</div><div class="value" data-summary="errors_total">-</div></div>
<div class="card"><div class="label" data-summary="rate_label">Requests / s</div>
<div class="value" data-summary="request_rate">-</div></div>
<div class="card"><div class="label" data-summary="ttft_label">TTFT p50</div>
<div class="value" data-summary="ttft_p50">-</div></div>
<div class="card"><div class="label">Models</div><div class="value" data-summary="models">-</div></div>
</section>
<div class="scroll"><table><thead><tr><th class="text">Worker</th><th class="text">Model</th><th class="text">Role</th>
<th class="text" title="up: routed to; draining: finishing its requests, gets no new ones; ejected: its requests kept failing, it gets only a probe after a cooldown; down: not ready">Health</th>
<th class="text" title="Circuit breaker: closed (routed), open (ejected after failures in a row), half-open (one probe may go); with the failures in a row">Circuit</th>
<th title="Times the worker process restarted (seen as a new KV epoch)">Restarts</th>
<th title="Requests this orchestrator has answered through the worker since it started">Requests</th>
<th title="Requests this orchestrator has open on the worker now">In flight</th>
<th title="Sequences the worker's engine is decoding (its last load report)">Running</th>
<th title="Requests queued in the worker's engine (its last load report)">Waiting</th>
<th class="text" title="Share of the worker's KV cache blocks in use">KV cache</th>
<th title="Prefix blocks the router's index believes the worker holds">Indexed blocks</th></tr></thead>
<tbody id="workers"><tr><td class="empty" colspan="12">loading&hellip;</td></tr></tbody></table></div>
<h2>History</h2>
<p class="muted" id="history-note">loading&hellip;</p>
<div id="history"></div>
<template id="chart"><svg viewBox="0 0 340 130" role="img"></svg></template>
<script>
const NUMBER=new Intl.NumberFormat("en-US");
function set(name,text,flag){const el=document.querySelector('[data-summary="'+name+'"]');el.textContent=text;
  if(flag)el.classList.toggle(flag[0],flag[1]);}
function cell(field,text,cls){
  const td=document.createElement("td");td.dataset.field=field;td.textContent=text;
  if(cls)td.className=cls;return td;}
function withSub(field,text,sub){
  const td=cell(field,text,"text");const small=document.createElement("span");
  small.className="sub";small.textContent=sub;td.append(small);return td;}
function health(state){
  const td=cell("health","","text");const pill=document.createElement("span");
  pill.className="pill "+state;pill.textContent=state;td.append(pill);return td;}
function kvCache(w){
  const td=cell("kv","","text");
  if(!w.kv_blocks_total){td.append(field("kv_usage","no report yet"));return td;}
  // A nearly full cache means new prompts evict cached prefixes or wait, so the bar turns amber.
  const meter=document.createElement("span");meter.className=w.kv_usage>0.85?"meter high":"meter";
  const fill=document.createElement("span");fill.style.width=Math.min(100,w.kv_usage*100).toFixed(1)+"%";
  meter.append(fill);
  const blocks=field("kv_blocks",NUMBER.format(w.kv_blocks_used)+" / "+NUMBER.format(w.kv_blocks_total)+" blocks");
  blocks.className="sub";td.append(meter,field("kv_usage",(w.kv_usage*100).toFixed(1)+" %"),blocks);return td;}
function field(name,text){const span=document.createElement("span");span.dataset.field=name;
  span.textContent=text;return span;}
function ttft(ms){return ms===null?"no streams":ms<1000?ms.toFixed(1)+" ms":(ms/1000).toFixed(2)+" s";}
function row(w){
  const tr=document.createElement("tr");tr.dataset.worker=w.id;tr.className=w.state;
  tr.append(withSub("id",w.id,w.url),cell("model",w.model,"text"),cell("role",w.role,"text"),health(w.state),
    withSub("circuit",w.circuit.replace("_","-"),w.consecutive_failures+" failed in a row"),
    cell("restarts",NUMBER.format(w.restarts)),
    cell("requests_total",NUMBER.format(w.requests_total)),cell("in_flight",NUMBER.format(w.in_flight)),
    cell("running",NUMBER.format(w.running)),cell("waiting",NUMBER.format(w.waiting)),kvCache(w),
    cell("kv_blocks_indexed",NUMBER.format(w.kv_blocks_indexed)));
  return tr;}
function emptyRow(){
  const tr=document.createElement("tr");const td=cell("empty",
    "No workers yet: they appear here once discovery finds them and they answer /ready.","empty");
  td.colSpan=12;tr.append(td);return tr;}
// History: the page keeps the points it has and asks only for newer ones (?since=), so a long span
// costs one full load, then a point or none per poll.
// Every chart is a clone of the template's <svg>, whose namespace its lines and labels are made in.
const BLANK=document.getElementById("chart").content.firstElementChild,W=340,H=130,LEFT=54,BOTTOM=16,TOP=6;
const COLORS=["#2f6fde","#e08600","#1a7f37","#b42318","#8250df","#0a8a8a","#bf3989","#6e7781"];
const HISTORY={points:[],last:null,span:900};
const CHARTS=[
  {id:"request_rate",title:"Requests / s",series:()=>[["requests / s",m=>m.request_rate]],format:v=>v.toFixed(2)},
  {id:"ttft",title:"Time to first token",series:()=>[["p50",m=>m.ttft_p50_ms],["p99",m=>m.ttft_p99_ms]],format:ttft},
  {id:"itl",title:"Inter-token latency",series:()=>[["p50",m=>m.itl_p50_ms],["p99",m=>m.itl_p99_ms]],format:ttft},
  {id:"hit_rate",title:"Prefix-cache hit rate",max:1,series:()=>[["hit rate",m=>m.hit_rate]],format:percent},
  {id:"shares",title:"Share of requests per worker",max:1,format:percent,
    series:points=>workersIn(points).map(w=>[w,m=>w in m.shares?m.shares[w]:null])},
  // The KV tiers (optional): a chart appears once a worker reports its figures.
  {id:"tier_usage",optional:true,title:"KV usage per tier",max:1,format:percent,
    series:points=>keysIn(points,"tiers").map(t=>[t,m=>m.tiers[t]?.usage??null])},
  {id:"tier_hits",optional:true,title:"Tier hits: blocks restored / s",format:perSecond,
    series:points=>lowerTiers(points).map(t=>[t,m=>m.tiers[t]?.restored_per_s??null])},
  {id:"tier_stored",optional:true,title:"Blocks offloaded into a tier / s",format:perSecond,
    series:points=>lowerTiers(points).map(t=>[t,m=>m.tiers[t]?.stored_per_s??null])},
  {id:"tier_evictions",optional:true,title:"Blocks evicted / s",format:perSecond,
    series:points=>keysIn(points,"tiers").map(t=>[t,m=>m.tiers[t]?.evicted_per_s??null])},
  {id:"pulls",optional:true,title:"Peer pulls / s",format:perSecond,
    series:points=>keysIn(points,"pulls_per_s").map(o=>[o,m=>m.pulls_per_s[o]??null])}];
function percent(v){return (v*100).toFixed(v<0.1?1:0)+" %";}
function perSecond(v){return v.toFixed(v<10?2:0);}
function workersIn(points){return keysIn(points,"shares");}
function keysIn(points,name){const all=new Set();
  for(const p of points)for(const k of Object.keys(p[name]??{}))all.add(k);return [...all].sort();}
function lowerTiers(points){return keysIn(points,"tiers").filter(t=>t!=="device");}
function mergeHistory(h){
  // True when new points came: redrawing every chart each second is wasted work with hundreds of workers.
  HISTORY.span=h.span_seconds;HISTORY.points.push(...h.points);
  if(h.points.length)HISTORY.last=h.points[h.points.length-1].wall;
  const horizon=HISTORY.last-HISTORY.span;HISTORY.points=HISTORY.points.filter(p=>p.wall>horizon);
  const span=duration(h.span_seconds),every=duration(h.interval_seconds);
  document.getElementById("history-note").textContent=HISTORY.points.length?
    "Last "+span+", a point every "+every+", each over the "+duration(h.window_seconds)+" before it.":
    "The first points appear after "+every+" (then one every "+every+", kept "+span+").";
  return h.points.length>0;}
function duration(s){return s<120?s+" s":Math.round(s/60)+" min";}
function svgEl(name,attrs,text){const el=document.createElementNS(BLANK.namespaceURI,name);
  for(const [k,v] of Object.entries(attrs))el.setAttribute(k,v);if(text!==undefined)el.textContent=text;return el;}
function niceMax(v){if(!(v>0))return 1;const step=10**Math.floor(Math.log10(v));
  return [1,2,5,10].map(m=>m*step).find(m=>m>=v);}
function linePath(values,x,y){
  // A null (no observation in that window) breaks the line instead of drawing it down to zero.
  let d="",isOpen=false;
  for(const [t,v] of values){if(v===null){isOpen=false;continue;}
    d+=(isOpen?"L":"M")+x(t).toFixed(1)+" "+y(v).toFixed(1);isOpen=true;}
  return d;}
function drawChart(chart,series,points){
  const t1=HISTORY.last,t0=t1-HISTORY.span,lines=series.map(([name,get])=>
    [name,points.map(p=>[p.wall,p.model?get(p.model)??null:null])]);
  const peak=lines.reduce((most,[,vs])=>vs.reduce((m,[,v])=>Math.max(m,v??0),most),0);
  const top=chart.max??niceMax(peak),x=t=>LEFT+(W-LEFT-4)*(t-t0)/(t1-t0||1),y=v=>TOP+(H-TOP-BOTTOM)*(1-v/top);
  const svg=BLANK.cloneNode();svg.dataset.chart=chart.id;svg.setAttribute("aria-label",chart.title);
  svg.append(svgEl("line",{class:"axis",x1:LEFT,y1:y(0),x2:W-4,y2:y(0)}),
    svgEl("line",{class:"axis",x1:LEFT,y1:y(top),x2:W-4,y2:y(top),"stroke-dasharray":"2 3"}),
    svgEl("text",{x:LEFT-4,y:y(top)+4,"text-anchor":"end"},chart.format(top)),
    svgEl("text",{x:LEFT-4,y:y(0),"text-anchor":"end"},chart.format(0)),
    svgEl("text",{x:LEFT,y:H-2},"-"+duration(HISTORY.span)),
    svgEl("text",{x:W-4,y:H-2,"text-anchor":"end"},new Date(t1*1000).toLocaleTimeString("en-GB")));
  let drawn=0;
  lines.forEach(([name,values],i)=>{const color=COLORS[i%COLORS.length],shown=values.filter(([,v])=>v!==null);
    drawn+=shown.length;
    svg.append(svgEl("path",{d:linePath(values,x,y),stroke:color,"data-series":name,"data-count":shown.length}));
    // The latest value as a dot, so a series with one point so far is visible too.
    if(shown.length){const [t,v]=shown[shown.length-1];svg.append(svgEl("circle",{cx:x(t),cy:y(v),r:2.5,fill:color}));}});
  svg.dataset.points=drawn;return [svg,legend(chart,lines)];}
function legend(chart,lines){
  const div=document.createElement("div");div.className="legend";const max=8;
  const latest=lines.map(([name,values],i)=>{const shown=values.filter(([,v])=>v!==null);
    return {name,color:COLORS[i%COLORS.length],value:shown.length?shown[shown.length-1][1]:null};});
  // Many workers: name the busiest few, count the rest.
  const named=latest.length>max?[...latest].sort((a,b)=>(b.value??-1)-(a.value??-1)).slice(0,max):latest;
  for(const item of named){const span=document.createElement("span"),swatch=document.createElement("span");
    swatch.className="swatch";swatch.style.background=item.color;
    span.append(swatch,item.name+" "+(item.value===null?"-":chart.format(item.value)));div.append(span);}
  if(latest.length>max)div.append(latest.length-max+" more");
  return div;}
function renderHistory(){
  const models=[...new Set(HISTORY.points.flatMap(p=>Object.keys(p.models)))].sort();
  const sections=models.map(model=>{
    const section=document.createElement("section"),grid=document.createElement("div");
    section.dataset.model=model;grid.className="charts";
    const title=document.createElement("h3");title.textContent=model;section.append(title,grid);
    const points=HISTORY.points.map(p=>({wall:p.wall,model:p.models[model]}));
    const present=points.filter(p=>p.model).map(p=>p.model);
    for(const chart of CHARTS){const series=chart.series(present);
      if(!series.length&&chart.optional)continue;  // no tier reported: no tier chart
      const figure=document.createElement("figure"),caption=document.createElement("figcaption");
      figure.className="chart";caption.textContent=chart.title;
      figure.append(caption,...drawChart(chart,series,points));grid.append(figure);}
    return section;});
  document.getElementById("history").replaceChildren(...sections);}
function render(data){
  const up=data.workers.filter(w=>w.state==="up").length,period=" ("+data.window_seconds+" s)";
  set("workers",up+" / "+data.workers.length,["bad",up===0]);
  set("requests_total",NUMBER.format(data.requests_total));set("errors_total",NUMBER.format(data.errors_total));
  set("rate_label","Requests / s"+period);set("request_rate",data.request_rate_per_s.toFixed(2));
  set("ttft_label","TTFT p50"+period);set("ttft_p50",ttft(data.ttft_p50_ms),["none",data.ttft_p50_ms===null]);
  set("models",data.models.length?data.models.join(", "):"none");
  const rows=data.workers.length?data.workers.map(row):[emptyRow()];
  document.getElementById("workers").replaceChildren(...rows);}
function showStatus(text,isStale){const s=document.getElementById("status");s.textContent=text;
  s.className=isStale?"stale":"muted";}
async function refresh(){
  try{
    const since=HISTORY.last===null?"":"?since="+HISTORY.last;
    const response=await fetch("dashboard/data"+since,{cache:"no-store"});
    if(!response.ok)throw new Error("HTTP status "+response.status);
    const data=await response.json();
    render(data);if(mergeHistory(data.history))renderHistory();
    showStatus("updated "+new Date().toLocaleTimeString("en-GB"),false);
  }catch(e){showStatus("orchestrator unreachable ("+e.message+"); retrying every second",true);}
}
refresh();setInterval(refresh,1000);
</script></body></html>
"""
