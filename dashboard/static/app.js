"use strict";
const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = {direct: "#2e7d32", relay: "#8a5a00", none: "#c62828", unknown: "#9aa3ad"};
function el(name, attrs, text) {
  const e = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function cell(tr, text, cls) { const td = document.createElement("td"); td.textContent = text ?? "–"; if (cls) td.className = cls; tr.appendChild(td); }

function drawTopology(topo) {
  const edgesG = document.getElementById("edges"), nodesG = document.getElementById("nodes");
  edgesG.replaceChildren(); nodesG.replaceChildren();
  const n = topo.nodes.length, cx = 280, cy = 210, r = n > 1 ? 160 : 0, pos = {};
  topo.nodes.forEach((node, i) => {
    const a = -Math.PI / 2 + 2 * Math.PI * i / Math.max(n, 1);
    pos[node.id] = {x: cx + r * Math.cos(a), y: cy + r * Math.sin(a), name: node.name};
  });
  const asym = new Set(topo.asymmetric.map(a => a.a_id + ">" + a.b_id));
  for (const e of topo.edges) {
    const p = pos[e.from], q = pos[e.to];
    if (!p || !q) continue;
    // Two directions of a pair side by side: offset each to its right.
    const dx = q.x - p.x, dy = q.y - p.y, len = Math.hypot(dx, dy) || 1;
    const ox = -dy / len * 7, oy = dx / len * 7, shrink = 30 / len;
    const x1 = p.x + dx * shrink + ox, y1 = p.y + dy * shrink + oy, x2 = q.x - dx * shrink + ox, y2 = q.y - dy * shrink + oy;
    const bad = asym.has(e.from + ">" + e.to);
    if (bad) edgesG.appendChild(el("line", {x1, y1, x2, y2, stroke: "#ffcdd2", "stroke-width": 12, "stroke-linecap": "round", class: "asym-halo"}));
    const line = el("line", {x1, y1, x2, y2, stroke: COLORS[e.path] || COLORS.unknown,
      "stroke-width": bad ? 3 : 2, "stroke-dasharray": e.path === "relay" ? "7 5" : (e.path === "unknown" ? "2 4" : "none"),
      "marker-end": "url(#arrow)", class: "edge path-" + e.path + (bad ? " asymmetric" : ""),
      "data-from": e.from_name, "data-to": e.to_name, "data-path": e.path});
    line.appendChild(el("title", {}, `${e.from_name}→${e.to_name}: ${e.path}` + (e.rtt_ms != null ? `, ${e.rtt_ms} ms ${e.path}` : "") + (e.since_s != null ? `, for ${Math.round(e.since_s)} s` : "")));
    edgesG.appendChild(line);
    if (bad) {
      const label = el("text", {x: (x1 + x2) / 2 + ox * 2, y: (y1 + y2) / 2 + oy * 2, "text-anchor": "middle",
        fill: "#c62828", "font-size": 12, "font-weight": 700, class: "asym-label",
        "data-from": e.from_name, "data-to": e.to_name}, `${e.from_name}→${e.to_name}: ${e.path}`);
      edgesG.appendChild(label);
    }
  }
  for (const node of topo.nodes) {
    const p = pos[node.id];
    const g = el("g", {class: "node", "data-name": node.name});
    g.appendChild(el("circle", {cx: p.x, cy: p.y, r: 26, fill: node.self ? "#e3f2fd" : "#fff",
      stroke: node.state === "suspect" ? "#b26a00" : "#37474f", "stroke-width": 2}));
    g.appendChild(el("text", {x: p.x, y: p.y + 4, "text-anchor": "middle", "font-size": 12, "font-weight": 600}, node.name));
    g.appendChild(el("text", {x: p.x, y: p.y + 42, "text-anchor": "middle", "font-size": 10, fill: "#56606b"}, node.prefix));
    nodesG.appendChild(g);
  }
  const box = document.getElementById("asymmetric");
  box.replaceChildren();
  for (const a of topo.asymmetric) {
    const d = document.createElement("div");
    d.className = "asym"; d.dataset.a = a.a; d.dataset.b = a.b; d.textContent = "asymmetric: " + a.detail;
    box.appendChild(d);
  }
  if (!topo.asymmetric.length) { const d = document.createElement("div"); d.className = "ok"; d.textContent = "no asymmetric pairs"; box.appendChild(d); }
}

function drawPeers(data) {
  const s = data.self;
  document.getElementById("me").textContent = `${s.name} · ${s.prefix} · ${s.addr} · relay ${s.relay_url || "–"}`;
  const join = document.getElementById("join");
  join.hidden = !data.join || data.join.joined;
  join.textContent = data.join && !data.join.joined ? data.join.status : "";
  const body = document.querySelector("#peers tbody");
  body.replaceChildren();
  for (const p of data.peers) {
    const tr = document.createElement("tr");
    // Replicas of one stage: "stage-1 (replica 2/2)"; a draining node says so beside its state.
    const replica = p.replicas > 1 ? ` (replica ${p.replica}/${p.replicas})` : "";
    cell(tr, p.name + replica); cell(tr, p.prefix); cell(tr, p.state + (p.draining ? " · draining" : ""), p.state);
    cell(tr, p.punched ? `${p.path_out} (punched)` : p.path_out, p.path_out);
    if (p.punched) tr.lastChild.title = `through its NAT, at ${p.punched}`;
    cell(tr, p.path_in, p.path_in); cell(tr, p.rtt_ms != null ? p.rtt_ms.toFixed(2) + (p.rtt_path === "relay" ? " r" : "") : null, p.rtt_path);
    tr.lastChild.title = p.rtt_ms != null ? `measured on the ${p.rtt_path} path` : "";
    cell(tr, `${p.out_ok}/${p.out_fail}`); cell(tr, p.in_seen ? `${p.in_seen.direct || 0}/${p.in_seen.relay || 0}` : "–");
    cell(tr, p.last_seen_s);
    tr.title = p.last_failure || "";
    body.appendChild(tr);
  }
}

const HOP_COLORS = {compute: "#1565c0", direct: "#2e7d32", relay: "#8a5a00"};
function drawTraces(t) {
  const box = document.getElementById("traces");
  if (!t.orchestrator || !t.per_token.length) { box.hidden = !t.orchestrator; return; }
  box.hidden = false;
  // A wait (a token in stage 0's outbox, streamed with the next few) is not on the way to
  // the next token: it is shown apart, not in the bar.
  const steps = t.per_token.filter(h => h.kind !== "wait"), waits = t.per_token.filter(h => h.kind === "wait");
  const total = steps.reduce((s, h) => s + h.ms, 0) || 1;
  document.getElementById("token-total").textContent = `${total.toFixed(2)} ms per token, from ${t.requests.length} recent requests`;
  document.getElementById("token-wait").textContent = waits.map(h =>
    `then ${h.ms.toFixed(2)} ms in ${h.name}, to reach the orchestrator with the tokens after it`).join("; ");
  const bar = document.getElementById("token-bar"), legend = document.getElementById("token-legend");
  bar.replaceChildren(); legend.replaceChildren();
  for (const h of steps) {
    const d = document.createElement("div");
    d.style.width = (100 * h.ms / total) + "%";
    d.style.background = h.kind === "compute" ? HOP_COLORS.compute : (HOP_COLORS[h.path] || "#777");
    d.title = `${h.name} (${h.kind}${h.path ? ", " + h.path : ""}): ${h.ms} ms`;
    d.textContent = h.name;
    bar.appendChild(d);
    const l = document.createElement("span"); l.textContent = `${h.name} ${h.ms.toFixed(2)} ms`; legend.appendChild(l);
  }
}

// Bound beyond loopback, the API wants the node's token: the page is opened as /?token=TOKEN
// and passes it on as a header (Referrer-Policy: no-referrer keeps the URL out of Referer).
const TOKEN = new URLSearchParams(location.search).get("token");
async function getJSON(path) {
  const r = await fetch(path, {cache: "no-store", headers: TOKEN ? {"X-Meshd-Token": TOKEN} : {}});
  if (r.status === 401) throw new Error(path + ": 401, open this page as /?token=TOKEN (printed when the node starts)");
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}
async function refresh() {
  try {
    const [topo, peers, traces] = await Promise.all([getJSON("/api/topology"), getJSON("/api/peers"), getJSON("/api/traces")]);
    drawTopology(topo); drawPeers(peers); drawTraces(traces);
    document.body.dataset.refreshed = String(Date.now());
  } catch (err) { document.getElementById("me").textContent = "dashboard unreachable: " + err.message; }
}
refresh();
setInterval(refresh, 1000);
