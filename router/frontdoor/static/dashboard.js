// The pdserve dashboard: polls /dashboard/data once a second and draws small
// canvas line charts per region. No dependencies.
"use strict";

const WINDOW_S = 600; // what the charts show
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed"];
let key = new URLSearchParams(location.hash.slice(1)).get("key") || sessionStorage.getItem("pdserve-key") || "";
let series = [];
let since = 0;
const charts = {}; // region -> {name: canvas}

const CHARTS = [
  { id: "pd", title: "instances (P:D); dashed: target", lines: [
      { label: "prefill", get: r => r.prefill }, { label: "decode", get: r => r.decode },
      { label: "prefill target", get: r => r.target_prefill, dash: true, color: 0 },
      { label: "decode target", get: r => r.target_decode, dash: true, color: 1 }] },
  { id: "queues", title: "queued requests", lines: [
      { label: "at prefill", get: r => r.prefill_queue }, { label: "at decode", get: r => r.decode_queue },
      { label: "decode batch", get: r => r.running }] },
  { id: "kv", title: "decode KV usage", max: 1, lines: [{ label: "KV used", get: r => r.kv_usage }] },
  { id: "ttft", title: "TTFT (s), last 30 s", slo: "ttft_s", lines: [
      { label: "p50", get: r => r.ttft && r.ttft.p50 }, { label: "p99", get: r => r.ttft && r.ttft.p99 }] },
  { id: "tpot", title: "TPOT (s), last 30 s", slo: "tpot_s", lines: [
      { label: "p50", get: r => r.tpot && r.tpot.p50 }, { label: "p99", get: r => r.tpot && r.tpot.p99 }] },
  { id: "bw", title: "KV transfer (MB/s)", lines: [
      { label: "sent", get: r => r.transfer_bytes_per_s / 1e6 }] },
  { id: "tiers", title: "prefix blocks from KV tiers (/s)", lines: [
      { label: "host hits", get: r => r.tier_hits_per_s && r.tier_hits_per_s.host },
      { label: "disk hits", get: r => r.tier_hits_per_s && r.tier_hits_per_s.disk },
      { label: "misses", get: r => r.tier_misses_per_s }] },
  { id: "moe", title: "MoE imbalance, worst layer (max/mean)", lines: [
      { label: "per EP rank", get: r => r.moe_imbalance && r.moe_imbalance.rank },
      { label: "per expert", get: r => r.moe_imbalance && r.moe_imbalance.expert }] },
];

function regionBox(name) {
  const box = document.createElement("section");
  box.className = "region";
  box.dataset.region = name;
  box.innerHTML = `<h2>${name}<span class="pd"></span></h2><div class="charts"></div>`;
  charts[name] = {};
  for (const c of CHARTS) {
    const fig = document.createElement("figure");
    fig.innerHTML = `<figcaption>${c.title}</figcaption>`;
    const canvas = document.createElement("canvas");
    canvas.dataset.chart = c.id;
    canvas.dataset.points = "0";
    fig.appendChild(canvas);
    box.querySelector(".charts").appendChild(fig);
    charts[name][c.id] = canvas;
  }
  document.getElementById("regions").appendChild(box);
}

function draw(canvas, chart, region, slo) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  // The last WINDOW_S seconds, or less while the cluster is younger (at least a minute).
  const now = Date.now() / 1000;
  const first = series.length ? series[0].t : now;
  const span = Math.min(WINDOW_S, Math.max(60, now - first));
  const t0 = now - span;
  const pts = series.filter(p => p.t >= t0 && p.regions[region]);
  const lines = chart.lines.map(l => pts.map(p => [p.t, l.get(p.regions[region])]).filter(([, v]) => v != null && isFinite(v)));
  let top = chart.max || 0;
  for (const line of lines) for (const [, v] of line) top = Math.max(top, v);
  const sloValue = chart.slo ? slo[chart.slo] : null;
  if (sloValue) top = Math.max(top, sloValue * 1.1);
  top = top > 0 ? top * 1.1 : 1;
  const L = 38, R = 6, T = 6, B = 16;
  const x = t => L + (t - t0) / span * (w - L - R);
  const y = v => T + (1 - v / top) * (h - T - B);
  g.strokeStyle = "#e2e6ee"; g.fillStyle = "#6b7280"; g.font = "10px system-ui"; g.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const v = top * i / 4, yy = y(v);
    g.beginPath(); g.moveTo(L, yy); g.lineTo(w - R, yy); g.stroke();
    g.fillText(v >= 10 ? v.toFixed(0) : v.toPrecision(2), 2, yy + 3);
  }
  g.fillText(span >= 120 ? `-${Math.round(span / 60)} min` : `-${Math.round(span)} s`, L, h - 3);
  g.fillText("now", w - R - 20, h - 3);
  if (sloValue) {
    g.strokeStyle = "#dc2626"; g.setLineDash([6, 4]);
    g.beginPath(); g.moveTo(L, y(sloValue)); g.lineTo(w - R, y(sloValue)); g.stroke();
    g.setLineDash([]); g.fillStyle = "#dc2626"; g.fillText("SLO", w - R - 22, y(sloValue) - 3);
  }
  let drawn = 0, legendX = L + 4;
  chart.lines.forEach((l, i) => {
    const color = COLORS[l.color !== undefined ? l.color : i % COLORS.length];
    g.strokeStyle = color; g.lineWidth = 1.6; g.setLineDash(l.dash ? [4, 3] : []);
    g.beginPath();
    lines[i].forEach(([t, v], j) => (j ? g.lineTo(x(t), y(v)) : g.moveTo(x(t), y(v))));
    g.stroke();
    drawn += lines[i].length;
    if (!l.dash) { g.fillStyle = color; g.fillText(l.label, legendX, T + 10); legendX += g.measureText(l.label).width + 12; }
  });
  g.setLineDash([]);
  canvas.dataset.points = String(drawn);
}

function render(data) {
  for (const name of data.regions) if (!charts[name]) regionBox(name);
  for (const name of data.regions) {
    const last = series.length ? series[series.length - 1].regions[name] : null;
    if (last) document.querySelector(`[data-region="${name}"] .pd`).textContent =
      `${last.prefill}P : ${last.decode}D   (target ${last.target_prefill ?? "?"}P : ${last.target_decode ?? "?"}D)`;
    for (const c of CHARTS) draw(charts[name][c.id], c, name, data.slo);
  }
  const rows = document.querySelector("#instances tbody");
  rows.innerHTML = "";
  for (const i of data.instances || []) {
    const tr = document.createElement("tr");
    tr.className = "instance";
    tr.dataset.node = i.node_id;
    // a Ray node id is 56 hex digits: its first 12 tell the nodes of a cluster apart
    for (const v of [i.instance, i.region, i.role, i.node_id.slice(0, 12), i.node_ip]) {
      const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
    }
    rows.appendChild(tr);
  }
  const body = document.querySelector("#events tbody");
  body.innerHTML = "";
  for (const e of data.events.slice().reverse()) {
    const tr = document.createElement("tr");
    tr.className = "event";
    for (const v of [new Date(e.t * 1000).toLocaleTimeString(), e.region, e.action, e.source, `${e.prefill}:${e.decode}`, e.reason]) {
      const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

async function poll() {
  try {
    const headers = key ? { Authorization: `Bearer ${key}` } : {};
    const resp = await fetch(`/dashboard/data?since=${since}`, { headers });
    if (resp.status === 401) {
      document.getElementById("auth").style.display = "block";
      document.getElementById("status").textContent = "API key needed";
      return;
    }
    const data = await resp.json();
    document.getElementById("auth").style.display = "none";
    series = series.concat(data.series).filter(p => p.t >= data.now - WINDOW_S);
    if (series.length) since = series[series.length - 1].t;
    render(data);
    document.getElementById("status").textContent =
      `live · ${new Date(data.now * 1000).toLocaleTimeString()} · SLO TTFT ${data.slo.ttft_s * 1000} ms, TPOT ${data.slo.tpot_s * 1000} ms`;
  } catch (err) {
    document.getElementById("status").textContent = `disconnected (${err})`;
  } finally {
    setTimeout(poll, 1000);
  }
}

document.getElementById("use-key").onclick = () => {
  key = document.getElementById("key").value.trim();
  sessionStorage.setItem("pdserve-key", key);
};
poll();
