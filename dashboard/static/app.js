"use strict";
// The page: one state object (GET /api/state, or pushed over the WebSocket /api/live) drawn
// as a readiness banner, the pipeline in order, the peers, and charts of the last minutes.
// Every string a node supplies goes in as text (textContent, setAttribute), never as markup.

const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = {direct: "#2e7d32", relay: "#b26a00", none: "#c62828", unknown: "#9aa3ad"};
const SERIES = ["#1565c0", "#6a1b9a", "#00838f", "#ef6c00", "#ad1457", "#2e7d32", "#5d4037", "#283593",
                "#9e9d24", "#00695c", "#c62828", "#546e7a"];
const NODE_W = 132, NODE_H = 50, ROW_GAP = 96, COL_MIN = 190, PAD_X = NODE_W / 2 + 18;
const MAX_SAMPLES = 600, WINDOW_S = 600, MAX_SERIES = 8, MAX_ROWS = 9;

// Bound beyond loopback, the API wants the node's token: the page is opened as /?token=TOKEN
// and passes it on as a header, and to the WebSocket as ?token= (a browser sets no header there).
const TOKEN = new URLSearchParams(location.search).get("token");

const view = {state: null, ring: null, samples: [], selected: null, hovered: null, lastUpdate: 0, updates: 0,
              layout: null};

// ------------------------------------------------------------------ small helpers

function el(name, attrs, text) {
  const e = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = text;
  return e;
}
function cell(tr, text, cls) { const td = h("td", cls, text ?? "–"); tr.appendChild(td); return td; }
function fmt(v) {
  if (v == null || !isFinite(v)) return "–";
  const a = Math.abs(v);
  return a >= 100 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : v.toFixed(2);
}
function ago(s) {
  if (s == null) return "–";
  return s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
}
const byId = id => document.getElementById(id);
const short = id => (id || "").slice(0, 8);
const edgeKey = e => `${e.from}>${e.to}`;

// ------------------------------------------------------------------ the banner

function drawBanner(state) {
  const ready = state.topology.readiness || {ready: false, why: [], warnings: []};
  const banner = byId("banner");
  banner.className = "banner " + (ready.ready ? "ready" : "not-ready");
  const hops = pipelineNames(state.topology);
  byId("banner-title").textContent = ready.ready
    ? `ready: the pipeline can serve (${hops.join(" → ")})`
    : `not ready: ${ready.why[0] || "unknown reason"}`;
  const why = byId("banner-why");
  why.replaceChildren(...ready.why.slice(1).map(w => h("li", null, w)));
  const warnings = byId("banner-warnings");
  warnings.replaceChildren(...(ready.warnings || []).map(w => h("li", null, "warning: " + w)));
}

function pipelineNames(topo) {
  const rows = (topo.readiness && topo.readiness.stages) || [];
  return ["orchestrator", ...rows.map(r => r.name)];
}

// What a reason blames: the stage it starts with, or the hop ("stage-0->stage-1: ...").
function blamed(topo) {
  const out = {stages: new Set(), hops: new Set()};
  for (const why of (topo.readiness && topo.readiness.why) || []) {
    const head = why.split(":")[0];
    if (head.includes("->")) out.hops.add(head.replace("->", ">"));
    else out.stages.add(head);
  }
  return out;
}

// ------------------------------------------------------------------ the topology

function columnOf(node, expected) {
  if (node.role === "orchestrator") return 0;
  if (node.role === "stage" && node.stage != null && node.stage < expected) return node.stage + 1;
  return -1;
}

// Nodes in pipeline order: a column per role (orchestrator, stage-0, ..), replicas stacked.
function layout(topo, width) {
  const rows = (topo.readiness && topo.readiness.stages) || [];
  const stageNums = topo.nodes.filter(n => n.role === "stage" && n.stage != null).map(n => n.stage + 1);
  const expected = rows.length || Math.max(0, ...stageNums);
  const columns = [{title: "orchestrator", items: []}];
  for (let k = 0; k < expected; k++) columns.push({title: `stage-${k}`, items: []});
  const others = {title: "other", items: []};
  for (const node of topo.nodes) {
    const c = columnOf(node, expected);
    (c < 0 ? others : columns[c]).items.push({kind: "node", node, key: node.id, name: node.name});
  }
  if (others.items.length) columns.push(others);
  if (expected > 0) {
    columns.forEach((col, c) => {
      if (!col.items.length && c <= expected) {
        col.items.push({kind: "ghost", key: "ghost:" + col.title, name: col.title});
      }
    });
  }
  const used = columns.filter(col => col.items.length);
  const n = used.length;
  const gap = n > 1 ? Math.max(COL_MIN, (width - 2 * PAD_X) / (n - 1)) : 0;
  const total = n > 1 ? Math.max(width, 2 * PAD_X + gap * (n - 1)) : width;
  const pos = {};
  used.forEach((col, c) => {
    col.x = n > 1 ? PAD_X + c * gap : total / 2;
    col.items.forEach((item, i) => {
      pos[item.key] = {x: col.x, y: (i - (col.items.length - 1) / 2) * ROW_GAP, col: c, item};
    });
  });
  return {columns: used, pos, width: total, expected};
}

// A hop of the pipeline: orchestrator → stage-0 → … → last, the last back to stage-0 (the next
// token) and to the orchestrator (the tokens streamed).
function hopKind(a, b, expected) {
  if (!a || !b) return null;
  const ca = columnOf(a, expected), cb = columnOf(b, expected);
  if (ca < 0 || cb < 0 || expected < 1) return null;
  if (cb === ca + 1) return "forward";
  if (ca === expected && cb === 1 && expected > 1) return "feedback: the next token";
  if (ca === expected && cb === 0) return "stream: tokens to the orchestrator";
  return null;
}

// Where the ray from a node's centre toward ``to`` leaves its box (and a small gap).
function exitPoint(c, to) {
  const dx = to.x - c.x, dy = to.y - c.y;
  const s = 1 / Math.max(Math.abs(dx) / (NODE_W / 2 + 4), Math.abs(dy) / (NODE_H / 2 + 4), 1e-9);
  return {x: c.x + dx * s, y: c.y + dy * s};
}

// Each direction of a pair bows to its own left, so the two never share a line: forward hops
// above the row of nodes, the way back below it; longer spans bow further, over the nodes between.
function curveOf(p, q) {
  const span = Math.abs(p.col - q.col);
  const bow = span === 0 ? 56 : span === 1 ? 34 : 2 * (NODE_H / 2 + 30 + 20 * (span - 2));
  const dx = q.x - p.x, dy = q.y - p.y, len = Math.hypot(dx, dy) || 1;
  const nx = dy / len, ny = -dx / len;
  const c = {x: (p.x + q.x) / 2 + nx * bow, y: (p.y + q.y) / 2 + ny * bow};
  const a = exitPoint(p, c), b = exitPoint(q, c);
  return {a, b, c, nx, ny};
}
function at(cv, t) {
  const u = 1 - t;
  return {x: u * u * cv.a.x + 2 * u * t * cv.c.x + t * t * cv.b.x,
          y: u * u * cv.a.y + 2 * u * t * cv.c.y + t * t * cv.b.y};
}

function edgeText(e, asym) {
  if (asym) return `${e.from_name}→${e.to_name}: ${e.path}`;
  const rtt = e.rtt_ms != null ? ` ${fmt(e.rtt_ms)} ms` : "";
  return {direct: `direct${rtt}`, relay: `relay${rtt}`, none: "no path",
          unknown: e.why_unknown || "not reported"}[e.path] || e.path;
}

function overlaps(a, b, pad) {
  return a.x < b.x + b.w + pad && b.x < a.x + a.w + pad && a.y < b.y + b.h + pad && b.y < a.y + a.h + pad;
}

function drawTopology(state) {
  const topo = state.topology;
  const box = byId("topology-box");
  const width = Math.max(320, box.clientWidth - 2);
  const lay = layout(topo, width);
  view.layout = lay;
  const svgEl = byId("topology");
  const colsG = byId("columns"), edgesG = byId("edges"), nodesG = byId("nodes"), labelsG = byId("labels");
  colsG.replaceChildren(); edgesG.replaceChildren(); nodesG.replaceChildren(); labelsG.replaceChildren();
  const blame = blamed(topo);
  const asym = new Set(topo.asymmetric.map(a => a.a_id + ">" + a.b_id));
  const byNode = Object.fromEntries(topo.nodes.map(n => [n.id, n]));
  const obstacles = Object.values(lay.pos).map(p => ({x: p.x - NODE_W / 2 - 3, y: p.y - NODE_H / 2 - 3,
                                                       w: NODE_W + 6, h: NODE_H + 6}));

  // Edges: the curve, its arrow, a halo under an asymmetric one.  Past a few nodes, an edge
  // that is neither a pipeline hop nor in trouble (direct, or with no path reported yet: two
  // replicas that never exchanged a message) is drawn faint and unlabelled (hover a node to
  // see its edges): the hops and the trouble are what a reader looks for.
  const dense = topo.edges.length > 8;
  const drawn = [];
  for (const e of topo.edges) {
    const p = lay.pos[e.from], q = lay.pos[e.to];
    if (!p || !q) continue;
    const cv = curveOf(p, q);
    const bad = asym.has(e.from + ">" + e.to);
    const hop = hopKind(byNode[e.from], byNode[e.to], lay.expected);
    const d = `M${cv.a.x.toFixed(1)},${cv.a.y.toFixed(1)} Q${cv.c.x.toFixed(1)},${cv.c.y.toFixed(1)} ` +
              `${cv.b.x.toFixed(1)},${cv.b.y.toFixed(1)}`;
    if (bad) edgesG.appendChild(el("path", {d, stroke: "#ffcdd2", "stroke-width": 12, fill: "none",
                                            "stroke-linecap": "round", class: "asym-halo"}));
    const blamedHop = blame.hops.has(`${e.from_name}>${e.to_name}`);
    const minor = !hop && (e.path === "direct" || e.path === "unknown") && !bad;
    const key = edgeKey(e);
    const cls = ["edge", "path-" + e.path, bad ? "asymmetric" : "", hop ? "hop" : "", minor ? "minor" : "",
                 minor && dense ? "faint" : "",
                 blamedHop ? "blamed" : "", view.selected === key ? "selected" : "",
                 view.hovered === key ? "hot" : ""].filter(Boolean).join(" ");
    const path = el("path", {d, stroke: COLORS[e.path] || COLORS.unknown, fill: "none",
      "stroke-width": bad ? 3 : hop ? 3 : 1.6,
      "stroke-dasharray": e.path === "relay" ? "7 5" : (e.path === "unknown" ? "2 4" : "none"),
      "marker-end": `url(#arrow-${COLORS[e.path] ? e.path : "unknown"})`, class: cls, "data-key": key,
      "data-from": e.from_name, "data-to": e.to_name, "data-path": e.path});
    path.appendChild(el("title", {}, `${e.from_name}→${e.to_name}: ${e.path}` +
      (e.why_unknown ? ` (${e.why_unknown})` : "") +
      (e.rtt_ms != null ? `, ${fmt(e.rtt_ms)} ms` : "") + (e.since_s != null ? `, for ${ago(e.since_s)}` : "") +
      (hop && hop !== "forward" ? ` (${hop})` : "")));
    edgesG.appendChild(path);
    drawn.push({e, cv, bad, hop, key, labelled: !(minor && dense), pts: Array.from({length: 21}, (_, i) => at(cv, i / 20))});
  }

  // Nodes, and a dashed place for a stage nobody serves.
  for (const [key, p] of Object.entries(lay.pos)) {
    const item = p.item;
    if (item.kind === "ghost") {
      const g = el("g", {class: "ghost" + (blame.stages.has(item.name) ? " blamed" : ""), "data-key": key,
                         "data-name": item.name});
      g.appendChild(el("rect", {x: p.x - NODE_W / 2, y: p.y - NODE_H / 2, width: NODE_W, height: NODE_H, rx: 8,
                                fill: "#fff5f5", stroke: "#c62828", "stroke-dasharray": "6 4", "stroke-width": 2}));
      g.appendChild(el("text", {x: p.x, y: p.y - 4, "text-anchor": "middle", "font-size": 13, "font-weight": 650,
                                fill: "#b71c1c"}, item.name));
      g.appendChild(el("text", {x: p.x, y: p.y + 14, "text-anchor": "middle", "font-size": 11, fill: "#b71c1c"},
                       "no live owner"));
      nodesG.appendChild(g);
      continue;
    }
    const node = item.node;
    const cls = ["node", node.self ? "self" : "", blame.stages.has(node.name) ? "blamed" : "",
                 view.selected === key ? "selected" : "", view.hovered === key ? "hot" : ""].filter(Boolean);
    const g = el("g", {class: cls.join(" "), "data-key": key, "data-name": node.name});
    const stroke = node.state === "suspect" ? "#b26a00" : node.self ? "#1565c0" : "#455a64";
    g.appendChild(el("rect", {x: p.x - NODE_W / 2, y: p.y - NODE_H / 2, width: NODE_W, height: NODE_H, rx: 8,
                              fill: node.self ? "#e3f2fd" : "#fff", stroke, "stroke-width": node.self ? 2.5 : 1.6}));
    g.appendChild(el("text", {x: p.x, y: p.y - 4, "text-anchor": "middle", "font-size": 13, "font-weight": 650,
                              fill: "#1d232b", class: "node-name"}, node.name));
    const sub = node.prefix + (node.state === "suspect" ? " · suspect" : "");
    g.appendChild(el("text", {x: p.x, y: p.y + 14, "text-anchor": "middle", "font-size": 11,
                              "font-family": "ui-monospace, monospace", fill: node.state === "suspect" ? "#b26a00" : "#56606b",
                              class: "node-prefix"}, sub));
    g.appendChild(el("title", {}, `${node.name} ${node.prefix} (${node.state})${node.self ? ", this node" : ""}`));
    nodesG.appendChild(g);
  }

  // Labels: the most telling first (asymmetric, then not direct, then hops), each where it
  // overlaps no node and no other label, preferring spots that cross no other edge.
  drawn.sort((x, y) => rank(x) - rank(y));
  const placed = [];
  for (const d of drawn) {
    if (!d.labelled) continue;
    const text = edgeText(d.e, d.bad);
    const label = el("text", {class: (d.bad ? "asym-label" : "edge-label " + d.e.path), "data-key": d.key,
                              "data-from": d.e.from_name, "data-to": d.e.to_name, "text-anchor": "middle",
                              "dominant-baseline": "central"}, text);
    labelsG.appendChild(label);
    const bb = label.getBBox();
    const spot = bestSpot(d, bb.width, bb.height, placed, obstacles, drawn, lay.width);
    if (!spot) { label.remove(); continue; }  // nowhere free: the edge's title still says it
    label.setAttribute("x", spot.x.toFixed(1));
    label.setAttribute("y", spot.y.toFixed(1));
    placed.push({x: spot.x - bb.width / 2, y: spot.y - bb.height / 2, w: bb.width, h: bb.height});
  }

  // Column titles above each column, then fit the drawing's height to what it holds.
  let top = Infinity, bottom = -Infinity;
  for (const p of Object.values(lay.pos)) { top = Math.min(top, p.y - NODE_H / 2); bottom = Math.max(bottom, p.y + NODE_H / 2); }
  for (const d of drawn) for (const pt of d.pts) { top = Math.min(top, pt.y); bottom = Math.max(bottom, pt.y); }
  for (const b of placed) { top = Math.min(top, b.y); bottom = Math.max(bottom, b.y + b.h); }
  if (!isFinite(top)) { top = -40; bottom = 40; }
  const titleY = top - 12;
  for (const col of lay.columns) {
    colsG.appendChild(el("text", {x: col.x, y: titleY, "text-anchor": "middle", class: "col-title"},
                         col.title));
  }
  top = titleY - 14;
  bottom += 10;
  const heightPx = Math.ceil(bottom - top);
  svgEl.setAttribute("width", Math.ceil(lay.width));
  svgEl.setAttribute("height", heightPx);
  svgEl.setAttribute("viewBox", `0 ${top.toFixed(1)} ${Math.ceil(lay.width)} ${heightPx}`);
  markHot();
}

function rank(d) {
  return (d.bad ? 0 : 40) + (d.e.path === "direct" ? 20 : 0) + (d.hop ? 0 : 10) + Math.abs(d.cv.a.x - d.cv.b.x) / 1e4;
}

function bestSpot(d, w, hgt, placed, obstacles, drawn, width) {
  let best = null, bestScore = Infinity;
  const ts = [0.5, 0.42, 0.58, 0.34, 0.66, 0.26, 0.74];
  ts.forEach((t, ti) => {
    const p = at(d.cv, t);
    for (const side of [1, -1]) {
      for (const extra of [3, 12, 24]) {
        const reach = Math.abs(d.cv.nx) * w / 2 + Math.abs(d.cv.ny) * hgt / 2 + extra;
        const x = Math.min(width - w / 2 - 2, Math.max(w / 2 + 2, p.x + d.cv.nx * side * reach));
        const y = p.y + d.cv.ny * side * reach;
        const b = {x: x - w / 2, y: y - hgt / 2, w, h: hgt};
        if (obstacles.some(o => overlaps(b, o, 1)) || placed.some(o => overlaps(b, o, 2))) continue;
        let crossings = 0;
        for (const other of drawn) {
          if (other === d) continue;
          for (const pt of other.pts) if (pt.x > b.x - 2 && pt.x < b.x + b.w + 2 && pt.y > b.y - 2 && pt.y < b.y + b.h + 2) crossings++;
        }
        const score = crossings * 10 + ti * 2 + (side < 0 ? 3 : 0) + extra / 6;
        if (score < bestScore) { bestScore = score; best = {x, y}; }
      }
    }
  });
  return best;
}

// ------------------------------------------------------------------ details (hover or click)

function dl(pairs) {
  const list = h("dl");
  for (const [k, v] of pairs) {
    if (v === undefined || v === null || v === "") continue;
    list.appendChild(h("dt", null, k));
    list.appendChild(h("dd", null, String(v)));
  }
  return list;
}

function peerById(state, id) {
  const p = state.peers;
  if (p.self.id === id) return p.self;
  return p.peers.find(x => x.id === id) || null;
}

function layersOf(state, name) {
  const l = state.layers && state.layers[name];
  return l ? `${l.first}..${l.last} of ${l.of}` : null;
}

function pathHistory(key) {
  const k = key.split(">").map(short).join(">");
  const seen = view.samples.filter(s => s.edges && s.edges[k]);
  let changes = 0;
  for (let i = 1; i < seen.length; i++) if (seen[i].edges[k][0] !== seen[i - 1].edges[k][0]) changes++;
  const counts = {};
  for (const s of seen) counts[s.edges[k][0]] = (counts[s.edges[k][0]] || 0) + 1;
  const share = Object.entries(counts).map(([p, n]) => `${p} ${Math.round(100 * n / seen.length)}%`).join(", ");
  return seen.length ? `${changes} change${changes === 1 ? "" : "s"} in ${ago(seen.at(-1).t - seen[0].t)} (${share})` : null;
}

function drawDetails(state) {
  const box = byId("details");
  const key = view.hovered || view.selected;
  const topo = state.topology;
  box.replaceChildren();
  if (key && key.startsWith("ghost:")) {
    const name = key.slice(6);
    box.appendChild(h("div", "title", `${name}: no live owner`));
    const why = ((topo.readiness && topo.readiness.why) || []).filter(w => w.startsWith(name + ":"));
    box.appendChild(dl([["why", why.join("; ") || "nobody serves it"], ["layers", layersOf(state, name)]]));
    return;
  }
  const node = key && topo.nodes.find(n => n.id === key);
  if (node) {
    const p = peerById(state, node.id) || {};
    const replica = p.replicas > 1 ? ` (replica ${p.replica} of ${p.replicas})` : "";
    box.appendChild(h("div", "title", `${node.name}${replica}${node.self ? " · this node" : ""}`));
    box.appendChild(dl([
      ["id", node.id], ["state", node.state + (p.draining ? ", draining" : "")], ["address", p.addr],
      ["relay", p.relay_url], ["layers", layersOf(state, node.name)], ["checkpoint", p.checkpoint],
      ["NAT", p.nat], ["our path out / in", p.path_out ? `${p.path_out} / ${p.path_in}` : null],
      ["RTT", p.rtt_ms != null ? `${fmt(p.rtt_ms)} ms (${p.rtt_path})` : null],
      ["probes ok / direct failures", p.out_ok != null ? `${p.out_ok} / ${p.out_fail}` : null],
      ["messages in, direct / relay", p.in_seen ? `${p.in_seen.direct || 0} / ${p.in_seen.relay || 0}` : null],
      ["last seen", p.last_seen_s != null ? `${ago(p.last_seen_s)} ago` : null],
      ["last failure", p.last_failure || (node.self ? null : "none")],
    ]));
    if (node.self) {
      const c = state.counters || {};
      const pick = Object.entries({...(c.swim || {}), ...(c.data || {})}).filter(([, v]) => v)
        .sort((x, y) => y[1] - x[1]).slice(0, 14);
      if (pick.length) box.appendChild(h("div", "counters", "counters: " + pick.map(([k, v]) => `${k} ${v}`).join(" · ")));
    }
    return;
  }
  const edge = key && topo.edges.find(e => edgeKey(e) === key);
  if (edge) {
    const pair = topo.asymmetric.find(a => (a.a_id === edge.from && a.b_id === edge.to) ||
                                           (a.b_id === edge.from && a.a_id === edge.to));
    const hop = view.layout ? hopKind(topo.nodes.find(n => n.id === edge.from), topo.nodes.find(n => n.id === edge.to),
                                      view.layout.expected) : null;
    box.appendChild(h("div", "title", `${edge.from_name} → ${edge.to_name}`));
    box.appendChild(dl([
      ["path", edge.path + (edge.punched ? " (punched through its NAT)" : "")],
      ["role", hop ? (hop === "forward" ? "a hop of the pipeline" : hop) : "not a pipeline hop (gossip, failover)"],
      ["RTT", edge.rtt_ms != null ? `${fmt(edge.rtt_ms)} ms` : null],
      ["for", edge.since_s != null ? ago(edge.since_s) : null], ["relay", edge.relay],
      ["direct failures", edge.direct_failures || null], ["last failure", edge.reason],
      ["history", pathHistory(key)], ["asymmetric", pair ? pair.detail : null],
    ]));
    return;
  }
  // Nothing chosen: each stage of the pipeline, who serves it, and what it holds.
  const rows = (topo.readiness && topo.readiness.stages) || [];
  if (!rows.length) { box.appendChild(h("div", null, "This node does not know the pipeline's stages yet.")); return; }
  const table = h("table", "stages");
  const head = h("tr");
  const known = Object.keys(state.layers || {}).length > 0;  // the orchestrator knows the model
  for (const t of ["stage", "serving", "replicas", ...(known ? ["layers"] : [])]) head.appendChild(h("th", null, t));
  table.appendChild(head);
  const orch = topo.nodes.filter(n => n.role === "orchestrator");
  const tr0 = h("tr"); cell(tr0, "orchestrator"); cell(tr0, orch.length ? "yes" : "no", orch.length ? "ok" : "none");
  cell(tr0, orch.map(n => n.prefix).join(", ") || "–", "replicas");
  if (known) cell(tr0, "–");
  table.appendChild(tr0);
  for (const r of rows) {
    const tr = h("tr");
    cell(tr, r.name); cell(tr, r.live ? `${r.live} of ${r.replicas.length}` : "no", r.live ? "ok" : "none");
    // One replica a line's worth, whole: the cell wraps between replicas, never inside one.
    const reps = cell(tr, r.replicas.length ? "" : "–", "replicas");
    r.replicas.forEach((x, i) => {
      const comma = i + 1 < r.replicas.length ? "," : "";
      reps.appendChild(h("span", "replica", `${x.prefix} ${x.state}${comma}`));
    });
    if (known) cell(tr, layersOf(state, r.name));
    table.appendChild(tr);
  }
  box.appendChild(table);
}

// ------------------------------------------------------------------ asymmetric pairs, peers

function drawAsymmetric(state) {
  const box = byId("asymmetric");
  box.replaceChildren();
  for (const a of state.topology.asymmetric) {
    const d = h("div", "asym");
    d.dataset.a = a.a; d.dataset.b = a.b;
    d.appendChild(h("div", null, "asymmetric: " + a.detail));
    const problem = (state.problems || []).find(p => p.kind === "asymmetric" && p.where === `${a.a}→${a.b}`);
    if (problem) d.appendChild(h("div", "check", "check: " + problem.check));
    box.appendChild(d);
  }
  if (!state.topology.asymmetric.length) box.appendChild(h("div", "ok", "no asymmetric pairs: every pair's two directions take the same path"));
}

function stageOrder(p) {
  if (p.role === "orchestrator") return [0, 0, p.prefix];
  if (p.role === "stage" && p.stage != null) return [1, p.stage, p.prefix];
  return [2, 0, p.name + p.prefix];
}
function compareOrder(a, b) {
  const x = stageOrder(a), y = stageOrder(b);
  for (let i = 0; i < 3; i++) if (x[i] !== y[i]) return x[i] < y[i] ? -1 : 1;
  return 0;
}

function drawPeers(state) {
  const data = state.peers, s = data.self;
  byId("me").textContent = `${s.name} · ${s.prefix} · ${s.addr} · relay ${s.relay_url || "–"}`;
  const join = byId("join");
  join.hidden = !data.join || data.join.joined;
  join.textContent = data.join && !data.join.joined ? data.join.status : "";
  const live = [s, ...data.peers.filter(p => p.state === "alive" || p.state === "suspect")].sort(compareOrder);
  const gone = data.peers.filter(p => p.state !== "alive" && p.state !== "suspect").sort(compareOrder);
  const body = document.querySelector("#peers tbody");
  body.replaceChildren();
  // Replicas of one stage among the live nodes: "stage-1 (replica 2/2)"; a departed one is not counted.
  const group = {};
  for (const p of live) if (p.replica_of) (group[p.replica_of] = group[p.replica_of] || []).push(p.id);
  for (const p of live) {
    const me = p.id === s.id;
    const tr = h("tr", (me ? "you" : "") + (view.selected === p.id ? " selected" : ""));
    tr.dataset.key = p.id;
    const mates = p.replica_of ? group[p.replica_of] : [];
    const replica = mates.length > 1 ? ` (replica ${mates.indexOf(p.id) + 1}/${mates.length})` : "";
    cell(tr, p.name + replica + (me ? " · this node" : ""));
    cell(tr, p.prefix);
    cell(tr, p.state + (p.draining ? " · draining" : ""), p.state);
    if (me) {
      for (let i = 0; i < 6; i++) cell(tr, "–");
      cell(tr, "", "failure");
    } else {
      const out = cell(tr, p.punched ? `${p.path_out} (punched)` : p.path_out, p.path_out);
      if (p.punched) out.title = `through its NAT, at ${p.punched}`;
      cell(tr, p.path_in, p.path_in);
      const rtt = cell(tr, p.rtt_ms != null ? fmt(p.rtt_ms) + (p.rtt_path === "relay" ? " r" : "") : null, p.rtt_path);
      rtt.title = p.rtt_ms != null ? `measured on the ${p.rtt_path} path` : "";
      cell(tr, `${p.out_ok}/${p.out_fail}`);
      cell(tr, p.in_seen ? `${p.in_seen.direct || 0}/${p.in_seen.relay || 0}` : "–");
      cell(tr, p.last_seen_s != null ? fmt(p.last_seen_s) : null);
      cell(tr, p.last_failure || "", "failure");
    }
    body.appendChild(tr);
  }
  byId("peers-count").textContent = `${live.length} live` + (gone.length ? `, ${gone.length} departed` : "");
  // Departed members (dead, left) fold away: a restarted stage is not shown twice.
  const departed = byId("departed");
  departed.hidden = !gone.length;
  byId("departed-summary").textContent = `${gone.length} departed`;
  const gbody = document.querySelector("#departed-table tbody");
  gbody.replaceChildren();
  for (const p of gone) {
    const tr = h("tr");
    cell(tr, p.name); cell(tr, p.prefix); cell(tr, p.state, p.state);
    cell(tr, p.state_age_s != null ? ago(p.state_age_s) : null); cell(tr, p.addr);
    cell(tr, p.last_failure || "", "failure");
    gbody.appendChild(tr);
  }
}

// ------------------------------------------------------------------ where one token's time goes

const HOP_COLORS = {compute: "#1565c0", direct: "#2e7d32", relay: "#b26a00"};
function drawTraces(t) {
  const box = byId("traces");
  if (!t.orchestrator || !t.per_token.length) { box.hidden = true; return; }
  box.hidden = false;
  // A wait (a token in stage 0's outbox, streamed with the next few) is not on the way to
  // the next token: it is shown apart, not in the bar.
  const steps = t.per_token.filter(x => x.kind !== "wait"), waits = t.per_token.filter(x => x.kind === "wait");
  const total = steps.reduce((s, x) => s + x.ms, 0) || 1;
  byId("token-total").textContent = `${total.toFixed(2)} ms per token, from ${t.requests.length} recent requests`;
  byId("token-wait").textContent = waits.map(x =>
    `then ${x.ms.toFixed(2)} ms in ${x.name}, to reach the orchestrator with the tokens after it`).join("; ");
  const bar = byId("token-bar"), legend = byId("token-legend");
  bar.replaceChildren(); legend.replaceChildren();
  for (const x of steps) {
    const d = h("div", null, x.name);
    d.style.width = (100 * x.ms / total) + "%";
    d.style.background = x.kind === "compute" ? HOP_COLORS.compute : (HOP_COLORS[x.path] || "#777");
    d.title = `${x.name} (${x.kind}${x.path ? ", " + x.path : ""}): ${x.ms} ms`;
    bar.appendChild(d);
    legend.appendChild(h("span", null, `${x.name} ${x.ms.toFixed(2)} ms`));
  }
}

// ------------------------------------------------------------------ charts of the last minutes

function timeWindow() {
  const s = view.samples;
  if (!s.length) return null;
  const t1 = s.at(-1).t, t0 = Math.max(s[0].t, t1 - WINDOW_S);
  return {t0: Math.min(t0, t1 - 30), t1};
}

function spanText(seconds) {
  return seconds >= 90 ? `${Math.round(seconds / 60)} minutes` : `${Math.round(seconds)} seconds`;
}

// A chart's frame: the plot area, x (time) and y (value) scales, gridlines and tick labels.
function frame(svgEl, win, ymax, unit, left) {
  svgEl.replaceChildren();
  const W = Math.max(200, svgEl.clientWidth), H = svgEl.clientHeight || 150;
  svgEl.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const L = left ?? 40, R = 8, T = 8, B = 18;
  const x = t => L + (W - L - R) * (t - win.t0) / Math.max(1, win.t1 - win.t0);
  const y = v => T + (H - T - B) * (1 - v / ymax);
  if (unit !== null) {
    for (const v of [0, ymax / 2, ymax]) {
      svgEl.appendChild(el("line", {x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid"}));
      const text = String(Number(v.toPrecision(3)));
      svgEl.appendChild(el("text", {x: L - 4, y: y(v) + 3, "text-anchor": "end"}, text));
    }
  }
  svgEl.appendChild(el("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
  const span = win.t1 - win.t0;
  const ticks = [[win.t0, "start", `−${spanText(span).replace(" minutes", " min").replace(" seconds", " s")}`],
                 [win.t0 + span / 2, "middle", `−${spanText(span / 2).replace(" minutes", " min").replace(" seconds", " s")}`],
                 [win.t1, "end", "now"]];
  for (const [t, anchor, text] of ticks) svgEl.appendChild(el("text", {x: x(t), y: H - 5, "text-anchor": anchor}, text));
  return {x, y, W, H, L, R, T, B};
}

function emptyChart(svgEl, text) {
  svgEl.replaceChildren();
  const W = Math.max(200, svgEl.clientWidth), H = svgEl.clientHeight || 150;
  svgEl.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svgEl.appendChild(el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, text));
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 4, 6, 8, 10]) if (v <= m * p) return m * p;  // halves that read well
  return 10 * p;
}

function polyline(f, pts, color, extra) {
  // Gaps (null) split the line: a value that was not measured is not drawn as zero.
  const out = [];
  let run = [];
  for (const [t, v] of pts) {
    if (v == null) { if (run.length) out.push(run); run = []; continue; }
    run.push(`${f.x(t).toFixed(1)},${f.y(v).toFixed(1)}`);
  }
  if (run.length) out.push(run);
  return out.map(r => r.length === 1
    ? el("circle", {cx: r[0].split(",")[0], cy: r[0].split(",")[1], r: 2.5, fill: color})
    : el("polyline", {points: r.join(" "), fill: "none", stroke: color, "stroke-width": 1.8, ...(extra || {})}));
}

// The edges worth a line or a row, at most ``limit``: asymmetric ones first, then those that
// took another path than direct in the window, pipeline hops, and edges of departed nodes last.
function chartEdges(state, samples, limit) {
  const topo = state.topology, expected = view.layout ? view.layout.expected : 0;
  const byNode = Object.fromEntries(topo.nodes.map(n => [n.id, n]));
  const asym = new Set(topo.asymmetric.flatMap(a => [a.a_id + ">" + a.b_id, a.b_id + ">" + a.a_id]));
  const out = new Map();
  for (const e of topo.edges) {
    const k = `${short(e.from)}>${short(e.to)}`;
    out.set(k, {k, label: `${e.from_name}→${e.to_name}`,
                score: (asym.has(edgeKey(e)) ? 0 : 4) + (hopKind(byNode[e.from], byNode[e.to], expected) ? 0 : 1)});
  }
  for (let i = samples.length - 1; i >= 0; i--) {
    const s = samples[i];
    for (const [k, [path]] of Object.entries(s.edges || {})) {
      if (!out.has(k)) {
        const [a, b] = k.split(">");
        out.set(k, {k, label: `${(s.nodes || {})[a] || a}→${(s.nodes || {})[b] || b} (gone)`, score: 8, gone: true});
      }
      const item = out.get(k);
      if (path !== "direct" && path !== "unknown" && !item.troubled) { item.troubled = true; item.score -= 2; }
    }
  }
  return [...out.values()].map(x => ({...x, score: x.score + (x.troubled ? 0 : 2)}))
    .sort((a, b) => a.score - b.score).slice(0, limit);
}

function drawCharts(state) {
  const win = timeWindow();
  byId("history-span").textContent = win ? `The last ${spanText(win.t1 - win.t0)}` : "The last minutes";
  byId("history-note").textContent = view.samples.length ? `${view.samples.length} samples kept by the node` : "no samples yet";
  const rttSvg = byId("chart-rtt"), pathSvg = byId("chart-paths"), rateSvg = byId("chart-rate"), latSvg = byId("chart-latency");
  if (!win) { for (const s of [rttSvg, pathSvg, rateSvg, latSvg]) emptyChart(s, "no samples yet"); return; }
  const samples = view.samples.filter(s => s.t >= win.t0);
  const kind = rateCharts(samples);

  // RTT per edge, with a tick where its path changed.
  const edges = chartEdges(state, samples, MAX_SERIES);
  const series = edges.map(({k, label, gone}, i) => ({k, label, gone, color: SERIES[i % SERIES.length],
    pts: samples.map(s => [s.t, s.edges && s.edges[k] ? s.edges[k][1] : null])}));
  // The axis follows the bulk of the round trips, not one slow probe: at most twice their 95th
  // percentile; a point above that is drawn on the top edge.
  const values = series.flatMap(s => s.pts.map(p => p[1])).filter(v => v != null).sort((a, b) => a - b);
  const highest = values.length ? values[values.length - 1] : 0;
  const p95 = values.length ? values[Math.floor(0.95 * (values.length - 1))] : 0;
  const rmax = niceMax(Math.min(highest, 2 * p95) || highest);
  for (const s of series) s.pts = s.pts.map(([t, v]) => [t, v == null ? null : Math.min(v, rmax)]);
  const f = frame(rttSvg, win, rmax, "ms");
  const legend = byId("legend-rtt");
  legend.replaceChildren();
  for (const s of series) {
    for (const shape of polyline(f, s.pts, s.color, s.gone ? {"stroke-dasharray": "3 3"} : null)) rttSvg.appendChild(shape);
    let prev = null;
    for (const sample of samples) {
      const now = sample.edges && sample.edges[s.k] ? sample.edges[s.k][0] : null;
      if (prev && now && now !== prev && prev !== "unknown" && now !== "unknown") {
        const tick = el("line", {x1: f.x(sample.t), x2: f.x(sample.t), y1: f.T, y2: f.H - f.B,
                                 stroke: COLORS[now] || COLORS.unknown, "stroke-width": 2, "stroke-dasharray": "3 2"});
        tick.appendChild(el("title", {}, `${s.label}: ${prev} → ${now}`));
        rttSvg.appendChild(tick);
      }
      prev = now || prev;
    }
    const item = h("span");
    const swatch = h("i"); swatch.style.background = s.color;
    item.append(swatch, s.label);
    legend.appendChild(item);
  }
  if (!series.length) emptyChart(rttSvg, "no edges: this node knows no peer");

  drawTimeline(pathSvg, win, samples, chartEdges(state, samples, MAX_ROWS - 1));
  drawRates(rateSvg, latSvg, win, samples, kind);
}

function drawTimeline(svgEl, win, samples, edges) {
  const rows = [{label: "pipeline", value: s => s.ready ? "ready" : "not-ready", why: s => s.why}];
  for (const {k, label} of edges) {
    rows.push({label, value: s => s.edges && s.edges[k] ? s.edges[k][0] : null});
  }
  // The label column is as wide as the longest label, up to 45% of the chart; longer ones are cut.
  svgEl.replaceChildren();
  const probe = el("text", {x: 0, y: 0});
  svgEl.appendChild(probe);
  let widest = 40;
  for (const row of rows) { probe.textContent = row.label; widest = Math.max(widest, probe.getComputedTextLength()); }
  probe.remove();
  const left = Math.min(widest + 10, Math.max(200, svgEl.clientWidth) * 0.45);
  const f = frame(svgEl, win, 1, null, left);
  const rowH = Math.min(15, (f.H - f.T - f.B) / rows.length);
  const colors = {...COLORS, ready: "#66bb6a", "not-ready": "#e53935"};
  rows.forEach((row, i) => {
    const y0 = f.T + i * rowH;
    const label = el("text", {x: f.L - 6, y: y0 + rowH / 2 + 3, "text-anchor": "end"}, row.label);
    svgEl.appendChild(label);
    if (label.getComputedTextLength() > f.L - 8) {
      label.appendChild(el("title", {}, row.label));
      let text = row.label;
      while (text.length > 4 && label.getComputedTextLength() > f.L - 8) {
        text = text.slice(0, -2);
        label.firstChild.textContent = text + "…";
      }
    }
    samples.forEach((s, j) => {
      const v = row.value(s);
      if (v == null) return;
      // Each sample holds until the next one; the last until now (the plot's right edge).
      const x0 = Math.max(f.L, f.x(s.t)), x1 = Math.min(f.W - f.R, f.x(j + 1 < samples.length ? samples[j + 1].t : win.t1));
      const rect = el("rect", {x: x0, y: y0 + 1, width: Math.max(1, x1 - x0 + 0.5),
                               height: Math.max(2, rowH - 3), fill: colors[v] || COLORS.unknown});
      if (row.why && row.why(s)) rect.appendChild(el("title", {}, row.why(s)));
      svgEl.appendChild(rect);
    });
  });
  const legend = byId("legend-paths");
  legend.replaceChildren();
  for (const [name, color] of [["ready", colors.ready], ["not ready", colors["not-ready"]], ["direct", COLORS.direct],
                               ["relay", COLORS.relay], ["no path", COLORS.none]]) {
    const item = h("span"), swatch = h("i");
    swatch.style.background = color;
    item.append(swatch, name);
    legend.appendChild(item);
  }
}

// Which rate charts this node has: "orchestrator", "stage", or null (no pipeline service: the
// path charts take the room).  Shown or hidden before any chart is drawn, since each chart is
// drawn to the width the grid gives it.
function rateCharts(samples) {
  const orchestrator = samples.some(s => s.tokens_per_s != null || s.in_flight != null);
  const stage = !orchestrator && samples.some(s => s.steps_per_s != null);
  const kind = orchestrator ? "orchestrator" : stage ? "stage" : null;
  // The orchestrator's load now: requests running, and waiting in its queue for a slot.
  const load = samples.findLast(s => s.running != null);
  byId("cap-rate").textContent = stage ? "Compute steps/s at this stage"
    : "Tokens/s" + (load ? ` · ${load.running} running, ${load.waiting} waiting` : "");
  byId("cap-latency").textContent = stage ? "Compute per step, ms" : "Time to first token, ms";
  byId("fig-rate").hidden = !kind;
  byId("fig-latency").hidden = !kind;
  return kind;
}

function drawRates(rateSvg, latSvg, win, samples, kind) {
  const stage = kind === "stage";
  if (!kind) {
    byId("history-note").textContent += " · tokens/s and time to first token: on the orchestrator's page";
    return;
  }
  const rateKey = stage ? "steps_per_s" : "tokens_per_s", latKey = stage ? "step_ms" : "ttft_ms";
  const rate = samples.map(s => [s.t, s[rateKey]]), lat = samples.map(s => [s.t, s[latKey]]);
  const f1 = frame(rateSvg, win, niceMax(Math.max(0, ...rate.map(p => p[1] ?? 0))), "");
  const area = rate.filter(p => p[1] != null);
  if (area.length > 1) {
    const pts = area.map(([t, v]) => `${f1.x(t).toFixed(1)},${f1.y(v).toFixed(1)}`);
    rateSvg.appendChild(el("polygon", {points: `${f1.x(area[0][0])},${f1.y(0)} ${pts.join(" ")} ${f1.x(area.at(-1)[0])},${f1.y(0)}`,
                                       fill: "#bbdefb", opacity: 0.7}));
  }
  for (const shape of polyline(f1, rate, "#1565c0")) rateSvg.appendChild(shape);
  const measured = lat.filter(p => p[1] != null);
  if (!measured.length) {
    emptyChart(latSvg, stage ? "no compute in this window" : "no request in this window");
    return;
  }
  const f2 = frame(latSvg, win, niceMax(Math.max(...measured.map(p => p[1]))), "ms");
  for (const shape of polyline(f2, lat, "#6a1b9a")) latSvg.appendChild(shape);
  for (const [t, v] of measured) latSvg.appendChild(el("circle", {cx: f2.x(t), cy: f2.y(v), r: 2.5, fill: "#6a1b9a"}));
}

// ------------------------------------------------------------------ applying a state

function mergeSamples(ring, samples) {
  if (ring !== view.ring) { view.samples = []; view.ring = ring; }  // a restarted node: another ring
  if (!samples || !samples.length) return;
  const seen = new Set(view.samples.map(s => s.seq));
  for (const s of samples) if (!seen.has(s.seq)) view.samples.push(s);
  view.samples.sort((a, b) => a.seq - b.seq);
  if (view.samples.length > MAX_SAMPLES) view.samples = view.samples.slice(-MAX_SAMPLES);
}

function redraw() {
  const state = view.state;
  if (!state) return;
  drawBanner(state);
  drawPeers(state);
  drawTopology(state);
  drawAsymmetric(state);
  drawDetails(state);
  drawTraces(state.traces);
  drawCharts(state);
}

function apply(message) {
  mergeSamples(message.ring, message.samples);
  view.state = message.state;
  view.lastUpdate = Date.now();
  view.updates += 1;
  redraw();
  document.body.dataset.refreshed = String(view.lastUpdate);
  document.body.dataset.updates = String(view.updates);
  tickFreshness();
}

function tickFreshness() {
  const upd = byId("updated");
  if (!view.lastUpdate) return;
  const s = Math.max(0, Math.round((Date.now() - view.lastUpdate) / 1000));
  upd.textContent = `updated ${s} s ago`;
  upd.className = s > 5 ? "stale" : "";
  // An open feed that stopped pushing (a proxy holding it): drop it, poll, and dial again.
  if (socket && socket.readyState === WebSocket.OPEN && s > 6) socket.close();
}

function setFeed(mode, title) {
  const f = byId("feed");
  f.className = "feed " + mode;
  f.textContent = {live: "live", polling: "polling", offline: "offline", connecting: "connecting"}[mode];
  f.title = title || "";
}

// ------------------------------------------------------------------ getting the state

async function getJSON(path) {
  const r = await fetch(path, {cache: "no-store", headers: TOKEN ? {"X-Meshd-Token": TOKEN} : {}});
  if (r.status === 401) throw new Error(path + ": 401, open this page as /?token=TOKEN (printed when the node starts)");
  if (!r.ok) throw new Error(path + ": " + r.status);
  return r.json();
}

function lastSeq() { return view.samples.length ? view.samples.at(-1).seq : 0; }

let pollTimer = null, socket = null, retry = 1000;
async function poll() {
  try {
    let message = await getJSON("/api/state?since=" + lastSeq());
    if (message.ring !== view.ring && lastSeq()) message = await getJSON("/api/state?since=0");
    apply(message);
    if (!socket) setFeed("polling", "the live feed is not available: polling every 2 s");
  } catch (err) {
    byId("me").textContent = "dashboard unreachable: " + err.message;
    setFeed("offline", err.message);
  }
}
function startPolling() { if (pollTimer === null) { poll(); pollTimer = setInterval(poll, 2000); } }
function stopPolling() { if (pollTimer !== null) { clearInterval(pollTimer); pollTimer = null; } }

function connect() {
  if (!("WebSocket" in window)) { startPolling(); return; }
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const url = scheme + location.host + "/api/live" + (TOKEN ? "?token=" + encodeURIComponent(TOKEN) : "");
  let opened = false;
  try { socket = new WebSocket(url); } catch (err) { socket = null; startPolling(); return; }
  socket.onopen = () => { opened = true; retry = 1000; stopPolling(); setFeed("live", "pushed by the node over a WebSocket"); };
  socket.onmessage = ev => {
    try { apply(JSON.parse(ev.data)); } catch (err) { console.error("meshd: a pushed state failed to draw", err); }
  };
  socket.onclose = () => {
    socket = null;
    startPolling();  // the fallback, until the feed is back
    setTimeout(connect, opened ? 1000 : retry);
    retry = Math.min(30000, retry * 2);
  };
}

let resizeTimer = null;
window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(redraw, 100); });

// Hover previews a node or an edge in the details; a click keeps it there (a second click lets go).
const topoSvg = byId("topology");
topoSvg.addEventListener("mouseover", ev => {
  const t = ev.target.closest("[data-key]");
  const key = t ? t.dataset.key : null;
  if (key !== view.hovered) { view.hovered = key; if (view.state) { drawDetails(view.state); markHot(); } }
});
topoSvg.addEventListener("mouseleave", () => { view.hovered = null; if (view.state) { drawDetails(view.state); markHot(); } });
topoSvg.addEventListener("click", ev => {
  const t = ev.target.closest("[data-key]");
  const key = t ? t.dataset.key : null;
  view.selected = key && key !== view.selected ? key : null;
  redraw();
});
document.querySelector("#peers tbody").addEventListener("click", ev => {
  const tr = ev.target.closest("tr[data-key]");
  if (!tr) return;
  view.selected = tr.dataset.key !== view.selected ? tr.dataset.key : null;
  redraw();
});
// What the pointer is on stands out: an edge, or a node with every edge it has.
function markHot() {
  for (const e of topoSvg.querySelectorAll(".hot")) e.classList.remove("hot");
  const key = view.hovered;
  if (!key) return;
  for (const e of topoSvg.querySelectorAll("[data-key]")) {
    if (e.matches("text")) continue;
    const k = e.dataset.key;
    if (k === key || (e.matches(".edge") && (k.startsWith(key + ">") || k.endsWith(">" + key)))) e.classList.add("hot");
  }
}

setInterval(tickFreshness, 1000);
connect();
// A feed that neither opens nor fails (a proxy holding it): poll meanwhile.
setTimeout(() => { if (!view.lastUpdate) startPolling(); }, 3000);
