// meshllm live mesh page: polls /dashboard/state once a second and draws it (no libraries, no build step).
"use strict";

const POLL_MS = 1000;
const CHART_POINTS = 300; // the last five minutes
const KEY_STORE = "meshllm-dashboard-key";
const opened = new Set(), closed = new Set(); // decisions the user opened or closed (the newest opens by itself)
let lastOk = 0;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(c === null || c === undefined ? "" : String(c)));
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

const num = (v) => el("td", { class: "num" }, v);
const clock = (t) => new Date(t * 1000).toLocaleTimeString();
const stamp = (t) => (Date.now() / 1000 - t > 86400 ? new Date(t * 1000).toLocaleString() : clock(t)); // a date when not recent

function fmt(v) {
  if (v === null || v === undefined) return "–";
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2);
  if (a >= 0.001) return (v * 1000).toFixed(1) + "m";
  return (v * 1e6).toFixed(0) + "µ";
}

// ------------------------------------------------------------ workers
function renderWorkers(state) {
  const body = document.querySelector("#workers tbody");
  const workers = [...state.workers].sort((a, b) => (a.model + a.role + a.id).localeCompare(b.model + b.role + b.id));
  const rows = workers.map((w) => {
    const usage = w.kv_usage === null ? null : w.kv_usage;
    const bar = el("span", { class: "bar" }, el("b"));
    bar.firstChild.style.width = usage === null ? "0" : Math.min(100, usage * 100).toFixed(1) + "%";
    const kv = el("td", {}, bar, usage === null ? `${w.kv_active_blocks} blocks` : `${(usage * 100).toFixed(1)}% of ${w.kv_total_blocks}`);
    return el("tr", { "data-worker": w.id, "data-health": w.health },
      el("td", {}, w.model), el("td", {}, w.role), el("td", {}, w.id), el("td", { class: "dim" }, w.address),
      el("td", {}, el("span", { class: "badge " + w.health }, w.health)), kv,
      num(w.running), num(w.waiting), num(w.in_flight), num(w.queued_prefill_tokens), num(w.indexed_blocks));
  });
  if (!rows.length) rows.push(el("tr", {}, el("td", { colSpan: 11, class: "dim" }, "no workers")));
  body.replaceChildren(...rows);
  const note = state.router.note || "";
  document.getElementById("router-note").textContent = note;
}

// ------------------------------------------------------------ charts
function chart(id, points, series, colours = [0, 1, 2]) {
  const svg = document.getElementById(id);
  const w = svg.clientWidth || 300, h = svg.clientHeight || 120, left = 42, bottom = 14;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const values = points.flatMap((p) => series.map((s) => p[s])).filter((v) => v !== null && v !== undefined);
  const top = Math.max(...values, 0) * 1.1 || 1;
  // The x axis spans the history there is: at least a minute, at most CHART_POINTS seconds.
  const t1 = points.length ? points[points.length - 1].t : 0;
  const span = Math.min(CHART_POINTS, Math.max(60, points.length ? t1 - points[0].t : 0)), t0 = t1 - span;
  const x = (t) => left + ((t - t0) / span) * (w - left - 4);
  const y = (v) => h - bottom - (v / top) * (h - bottom - 4);
  const nodes = [
    svgEl("line", { class: "axis", x1: left, y1: h - bottom, x2: w, y2: h - bottom }),
    svgEl("line", { class: "axis", x1: left, y1: 2, x2: left, y2: h - bottom }),
  ];
  const label = (text, attrs) => { const t = svgEl("text", attrs); t.textContent = text; return t; };
  nodes.push(label(fmt(top), { x: 2, y: 10 }), label("0", { x: 2, y: h - bottom }), label(span >= 120 ? `−${Math.round(span / 60)} min` : `−${Math.round(span)} s`, { x: left + 2, y: h - 2 }), label("now", { x: w - 24, y: h - 2 }));
  series.forEach((s, i) => {
    let run = [];
    const flush = () => { if (run.length) nodes.push(svgEl("polyline", { class: "s" + colours[i], points: run.join(" ") })); run = []; };
    for (const p of points) {
      const v = p[s];
      if (v === null || v === undefined) flush();
      else run.push(`${x(p.t).toFixed(1)},${y(v).toFixed(1)}`);
    }
    if (run.length === 1) run.push(run[0].replace(/^[\d.]+/, (px) => (Number(px) + 2).toFixed(1))); // a lone point shows
    flush();
  });
  svg.replaceChildren(...nodes);
}

function renderCharts(state) {
  const pts = state.series.slice(-CHART_POINTS);
  document.getElementById("window").textContent = `up to the last 5 min · each point over the trailing ${state.window_s} s`;
  chart("chart-rate", pts, ["rps", "failed_ps"], [0, 2]);
  chart("chart-ttft", pts, ["ttft_p50", "ttft_p90", "ttft_p99"]);
  chart("chart-itl", pts, ["itl_p50", "itl_p90", "itl_p99"]);
  chart("chart-e2e", pts, ["e2e_p50", "e2e_p90", "e2e_p99"]);
  chart("chart-tokens", pts, ["tokens_ps", "inflight"]);
}

// ------------------------------------------------------------ decisions and events
const TERMS = [
  ["overlap_blocks", "overlap"], ["prefill_tokens", "prefill tok"], ["queued_prefill_tokens", "queued tok"],
  ["decode_blocks", "decode blk"], ["in_flight", "in flight"], ["prefilling", "prefilling"],
  ["resident_blocks", "resident"], ["total_blocks", "total"],
  ["new_blocks", "new"], ["evicted_hot_blocks", "evicted hot"], ["pressure", "pressure"],
  ["lower_tiers", "lower tiers"], ["restore_blocks", "restore"], ["wait_blocks", "wait"], ["cost", "cost"],
];
// Blocks a candidate would restore from its lower tiers, e.g. "host 30 · disk 4" (empty without).
const tiers = (ts) => el("td", {}, (ts || []).map((t) => `${t.tier} ${t.blocks}`).join(" · "));

function renderDecisions(state) {
  const box = document.getElementById("decisions");
  if (!state.decisions.length) {
    box.replaceChildren(el("p", { class: "dim" }, state.router.kind === "embedded" ? "no requests routed yet" : state.router.note));
    return;
  }
  const items = state.decisions.slice(0, 12).map((d, i) => {
    const key = d.request + "/" + d.leg;
    const head = el("tr", {}, el("th", {}, "worker"), ...TERMS.map(([, name]) => el("th", {}, name)));
    const rows = d.candidates.map((c) => el("tr", { class: c.chosen ? "chosen" : "" },
      el("td", {}, c.worker_id + (c.dp_rank ? `/${c.dp_rank}` : "")), ...TERMS.map(([k]) => (k === "lower_tiers" ? tiers(c[k]) : num(c[k])))));
    const n = d.candidates.length, rid = d.request;  // a digest of the request id (router/recent.py request_tag)
    const summary = el("summary", { title: "request " + d.request }, el("span", { class: "dim" }, clock(d.at) + "  "),
      `${d.model} · ${d.leg} → ${d.worker_id}`,
      el("span", { class: "dim" }, `  ${d.policy} · ${d.prompt_blocks} prompt blocks of ${d.block_size} · ${n} candidate${n === 1 ? "" : "s"} · ${rid}`));
    const details = el("details", { "data-decision": key }, summary, el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
    details.open = opened.has(key) || (i === 0 && !closed.has(key));
    summary.addEventListener("click", () => {
      const open = !details.open; // the click toggles it after this handler
      (open ? opened : closed).add(key);
      (open ? closed : opened).delete(key);
    });
    return details;
  });
  box.replaceChildren(...items);
}

function renderEvents(state) {
  const items = state.events.map((e) => el("li", { "data-kind": e.kind },
    el("span", { class: "dim" }, clock(e.at) + "  "), el("span", { class: "kind k-" + e.kind }, e.kind), e.text));
  if (!items.length) items.push(el("li", { class: "dim" }, "nothing yet"));
  document.getElementById("events").replaceChildren(...items);
}

// ------------------------------------------------------------ planner
const ARROWS = { up: "▲ up", down: "▼ down", hold: "hold" };
const workersCell = (d) => (d.direction === "hold" || d.target === null ? `${d.current ?? "?"}` : `${d.current ?? "?"} → ${d.target}`);

function plannerHead(p) {
  if (p.read_at === null) return "not read yet";
  if (!p.found) return `no planner state in etcd (namespace ${p.namespace}): no planner has run here`;
  const parts = [p.leader ? `${p.leader} leads` : "no planner leads"];
  const t = p.targets;
  if (t) parts.push(`targets TTFT ${fmt(t.ttft_s)}s · ITL ${fmt(t.itl_s)}s`);
  if (p.saved_at !== null) parts.push(`state saved ${stamp(p.saved_at)}` + (p.saved_by && p.saved_by !== p.leader ? ` by ${p.saved_by}` : ""));
  return parts.join(" · ");
}

// The panel shows only where the frontend can read a planner's keys (discovery in etcd).
function renderPlanner(state) {
  const section = document.getElementById("planner"), p = state.planner;
  section.hidden = !p;
  if (!p) return;
  document.getElementById("planner-head").textContent = plannerHead(p);
  section.dataset.leader = p.leader || "";
  const stale = p.note && p.read_at !== null ? ` · showing what was read at ${stamp(p.read_at)}` : "";
  document.getElementById("planner-note").textContent = p.note ? p.note + stale : "";
  const box = document.getElementById("planner-decisions");
  if (!p.decisions.length) {
    box.replaceChildren(...(p.found ? [el("p", { class: "dim" }, "no decisions yet")] : []));
    return;
  }
  const head = el("tr", {}, ...["time", "role", "workers", "direction", "wanted", "reason"].map((h) => el("th", {}, h)));
  const rows = p.decisions.map((d) => el("tr", { class: d.direction === "hold" ? "hold" : "change", "data-direction": d.direction },
    el("td", { class: "dim" }, d.at === null ? "–" : stamp(d.at)), el("td", {}, d.role), el("td", { class: "num" }, workersCell(d)),
    el("td", {}, el("span", { class: "dir " + d.direction }, ARROWS[d.direction] || d.direction)),
    num(d.wanted ?? "–"), el("td", { class: "reason" }, d.reason)));
  box.replaceChildren(el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows)));
}

function renderSummary(state) {
  const f = state.frontend, r = state.router;
  const healthy = state.workers.filter((w) => w.health === "healthy").length;
  const known = state.workers.some((w) => w.health !== "unknown");
  const routing = r.kind === "embedded" ? `embedded router (${r.mode})` : r.kind === "remote" ? `router ${r.addresses.join(", ")}` : "no router";
  const last = state.series.length ? state.series[state.series.length - 1] : null;
  document.getElementById("summary").textContent =
    `models: ${f.models.join(", ") || "none"} · ${state.workers.length} workers` + (known ? ` (${healthy} healthy)` : "") + ` · ${routing} · ` +
    `${f.inflight} in flight` + (last ? ` · ${fmt(last.rps)} req/s` : "") + (f.admitting ? "" : " · draining");
}

// ------------------------------------------------------------ polling
function headers() {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { Authorization: "Bearer " + key } : {};
}

async function poll() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch("/dashboard/state", { headers: headers(), cache: "no-store" });
    if (resp.status === 401) {
      document.getElementById("auth").hidden = false;
      status.textContent = "API key needed";
    } else if (resp.ok) {
      const state = await resp.json();
      document.getElementById("auth").hidden = true;
      renderSummary(state); renderWorkers(state); renderCharts(state); renderPlanner(state); renderDecisions(state); renderEvents(state);
      lastOk = Date.now();
      status.textContent = "updated " + clock(state.now);
      status.className = "status";
      document.body.dataset.updated = String(state.now);
    } else {
      status.textContent = `state: HTTP ${resp.status}`;
    }
  } catch (err) {
    status.textContent = lastOk ? `no answer since ${new Date(lastOk).toLocaleTimeString()}` : "cannot reach the frontend";
    status.className = "status stale";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.getElementById("auth").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_STORE, document.getElementById("key").value);
  document.getElementById("key").value = "";
});

poll();
