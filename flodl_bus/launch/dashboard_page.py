"""The dashboard's one page: markup, style and script inline, nothing fetched elsewhere.

The script opens ``/events`` and redraws from each snapshot. Every value from the run
goes into the page as text (``textContent``), never as markup: a dead letter's reason
is whatever someone wrote into the run's keys.
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>flodl-bus dashboard</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1em 2em; color: #222; background: #fafafa; }
h1 { font-size: 1.3em; margin: 0 0 .3em; }
h2 { font-size: 1.05em; margin: 1.2em 0 .4em; }
.muted { color: #777; }
.cards { display: flex; flex-wrap: wrap; gap: .6em; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: .5em .8em;
        min-width: 8em; }
.card .k { color: #777; font-size: .85em; }
.card .v { font-size: 1.2em; font-variant-numeric: tabular-nums; }
table { border-collapse: collapse; background: #fff; }
th, td { border: 1px solid #ddd; padding: .2em .6em; text-align: right;
         font-variant-numeric: tabular-nums; }
th { background: #f0f0f0; }
td.state, td.text { text-align: left; }
.dead { color: #b00; font-weight: bold; }
.shut { color: #a60; }
.open { color: #070; }
#trouble { color: #b00; }
svg { background: #fff; border: 1px solid #ddd; }
ul { margin: 0; padding-left: 1.2em; }
.charts { display: flex; flex-wrap: wrap; gap: 1em; }
</style>
</head>
<body>
<h1>run <span id="run">-</span> <span id="status" class="muted">connecting</span></h1>
<div class="muted"><span id="mode">-</span> &middot; <span id="job">-</span> &middot;
  updated <span id="age">-</span> <span id="trouble"></span></div>
<div class="cards">
  <div class="card"><div class="k">world</div><div class="v" id="world">-</div></div>
  <div class="card"><div class="k">epoch</div><div class="v" id="epoch">-</div></div>
  <div class="card"><div class="k">anchor</div><div class="v" id="anchor">-</div></div>
  <div class="card"><div class="k">averaging rounds</div><div class="v" id="rounds">-</div></div>
  <div class="card"><div class="k">gate</div><div class="v" id="gate">-</div></div>
  <div class="card"><div class="k">phase</div><div class="v" id="phase">-</div></div>
  <div class="card"><div class="k">dead letters</div><div class="v" id="dlq-count">-</div></div>
  <div class="card"><div class="k">final eval</div><div class="v" id="last-eval">-</div></div>
</div>
<h2>ranks</h2>
<table id="ranks"><thead><tr><th>rank</th><th>state</th><th>epoch</th><th>step</th>
<th>loss</th><th>steps/s</th><th>samples/s (last epoch)</th><th>window</th><th>heard</th>
</tr></thead><tbody></tbody></table>
<div class="charts">
 <div><h2>eval metric by epoch</h2><svg id="eval-chart" width="420" height="200"></svg></div>
 <div><h2>loss by epoch</h2><svg id="loss-chart" width="420" height="200"></svg></div>
</div>
<h2>epochs</h2>
<table id="epochs"><thead><tr><th>epoch</th><th>loss</th><th>eval</th><th>rounds</th>
<th>seconds</th><th>samples/s per rank</th><th>skipped</th></tr></thead><tbody></tbody></table>
<h2>deaths, re-formations, exits (<span id="event-count">0</span>)</h2>
<ul id="events"></ul>
<h2>dead letters</h2>
<ul id="dead-letters"></ul>
<p class="muted">Stream entries are shown as written (an observer holds no rank keys and
checks no MAC); liveness, the gate and the anchor are the coordinator's own view.</p>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
function num(x, digits) {
  if (x === null || x === undefined) return "-";
  return String(Number(Number(x).toPrecision(digits || 6)));
}
function text(el, value) { el.textContent = value; }
function cell(tr, value, cls) {
  const td = document.createElement("td");
  td.textContent = value;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}
function clock(ms) { return new Date(ms).toLocaleTimeString(); }
function list(ul, items, line) {
  ul.replaceChildren();
  for (const item of items) {
    const li = document.createElement("li");
    li.textContent = line(item);
    ul.appendChild(li);
  }
}
function chart(svg, points, color) {
  const NS = "http://www.w3.org/2000/svg";
  svg.replaceChildren();
  const w = svg.width.baseVal.value, h = svg.height.baseVal.value, pad = 34;
  if (!points.length) return;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => pad + (x - x0) / (x1 - x0) * (w - 2 * pad);
  const Y = (y) => h - pad + (y0 - y) / (y1 - y0) * (h - 2 * pad);
  const add = (name, attrs, content) => {
    const el = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    if (content !== undefined) el.textContent = content;
    svg.appendChild(el);
    return el;
  };
  add("polyline", {points: points.map((p) => X(p[0]) + "," + Y(p[1])).join(" "),
                   fill: "none", stroke: color, "stroke-width": 2});
  for (const p of points) {
    add("circle", {cx: X(p[0]), cy: Y(p[1]), r: 3, fill: color, "data-epoch": p[0],
                   "data-value": p[1]});
  }
  add("text", {x: 2, y: pad - 6, "font-size": 11}, num(y1, 4));
  add("text", {x: 2, y: h - pad + 4, "font-size": 11}, num(y0, 4));
  add("text", {x: pad, y: h - 8, "font-size": 11}, "epoch " + x0);
  add("text", {x: w - pad - 40, y: h - 8, "font-size": 11}, "epoch " + x1);
}
function draw(s) {
  text($("run"), s.run);
  const st = $("status");
  text(st, s.status);
  st.className = s.live ? "" : "muted";
  text($("mode"), s.mode || "-");
  text($("job"), s.job || "-");
  text($("age"), clock(s.now_ms));
  text($("trouble"), s.trouble || "");
  text($("world"), String(s.world_size));
  text($("epoch"), (s.epoch === null ? "-" : s.epoch) + (s.epochs ? "/" + s.epochs : ""));
  text($("anchor"), s.anchor === null ? "-" : String(s.anchor));
  text($("rounds"), String(s.rounds));
  const gate = $("gate");
  if (!s.gate) { text(gate, "-"); gate.className = "v"; }
  else if (s.gate.open) { text(gate, "open"); gate.className = "v open"; }
  else { text(gate, "shut: " + (s.gate.why || "?")); gate.className = "v shut"; }
  text($("phase"), s.phase || "-");
  text($("dlq-count"), String(s.dead_letters.count));
  const last = s.evals.length ? s.evals[s.evals.length - 1] : null;
  text($("last-eval"), last ? num(last.metric) + " (epoch " + last.epoch + ")" : "-");
  const ranks = $("ranks").tBodies[0];
  ranks.replaceChildren();
  for (const r of s.ranks) {
    const tr = document.createElement("tr");
    tr.dataset.rank = r.rank;
    cell(tr, String(r.rank), "rank");
    cell(tr, r.state, "state" + (r.state === "dead" ? " dead" : ""));
    cell(tr, r.epoch === null ? "-" : String(r.epoch), "epoch");
    cell(tr, r.step === null ? "-" : String(r.step), "step");
    cell(tr, num(r.loss, 4), "loss");
    cell(tr, num(r.steps_per_s, 3), "steps-per-s");
    cell(tr, num(r.samples_per_s, 4), "samples-per-s");
    cell(tr, r.window === null ? "-" : String(r.window), "window");
    cell(tr, r.heard_s === null ? "-" : num(r.heard_s, 2) + "s", "heard");
    ranks.appendChild(tr);
  }
  const rows = $("epochs").tBodies[0];
  rows.replaceChildren();
  for (const e of s.epoch_rows) {
    const tr = document.createElement("tr");
    tr.dataset.epoch = e.epoch;
    cell(tr, String(e.epoch), "epoch");
    cell(tr, num(e.loss), "loss");
    cell(tr, num(e.eval), "eval");
    cell(tr, e.rounds_total === undefined ? "-" : String(e.rounds_total), "rounds");
    cell(tr, num(e.epoch_s, 3), "seconds");
    cell(tr, (e.samples_per_s || []).map((x) => num(x, 4)).join("  "), "samples-per-s");
    // batches a non-finite loss skipped (metrics.csv's skipped_batches)
    cell(tr, e.skipped === undefined ? "-" : String(e.skipped), "skipped");
    rows.appendChild(tr);
  }
  chart($("eval-chart"), s.evals.map((e) => [e.epoch, e.metric]), "#1565c0");
  chart($("loss-chart"), s.epoch_rows.filter((e) => e.loss !== null && e.loss !== undefined)
    .map((e) => [e.epoch, e.loss]), "#c62828");
  text($("event-count"), String(s.event_count));
  list($("events"), s.events, (e) => clock(e.at_ms) + "  " + e.text);
  list($("dead-letters"), s.dead_letters.recent,
       (d) => clock(d.at_ms) + "  " + d.stream + " " + d.entry + ": " + d.reason);
}
const source = new EventSource("/events");
source.onmessage = (ev) => draw(JSON.parse(ev.data));
source.onerror = () => text($("trouble"), "dashboard unreachable; retrying");
</script>
</body>
</html>
"""
