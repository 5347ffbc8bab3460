// agentrl viewer: curves, episode browser, token view, diff. Vanilla JS, no build step.
// The server (agentrl/viewer/server.py) streams three lists behind cursors: metric rows,
// episode summaries and fate updates; this page polls /api/poll to follow a live run. A poll
// returns a page of each list and reads a few MB of each file: while `more`, it polls again at once.
"use strict";

const S = {
  meta: null, epoch: 0, cursor: { metrics: 0, episodes: 0, fates: 0 },
  metrics: [], episodes: new Map(), order: [], fates: new Map(), status: {},
  selected: null, colourBy: "logprob", dirty: { charts: true, list: true, diff: true },
};
const SVGNS = "http://www.w3.org/2000/svg";
const $ = (sel) => document.querySelector(sel);

// ------------------------------------------------------------------ DOM helpers (text only: no innerHTML)

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v; else if (k === "style") e.style.cssText = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
  }
  for (const k of kids.flat()) if (k !== null && k !== undefined) e.append(k instanceof Node ? k : String(k));
  return e;
}
function sv(tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmt(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (a >= 100 || Number.isInteger(v)) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2);
  return a === 0 ? "0" : v.toPrecision(digits > 2 ? 2 : digits);
}
const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);

// ------------------------------------------------------------------ polling

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return r.json();
}

async function poll() {
  if (S.inflight) return;
  S.inflight = true;
  clearTimeout(S.timer);
  let more = false;
  try {
    const c = S.cursor;
    const d = await getJSON(`api/poll?epoch=${S.epoch}&metrics=${c.metrics}&episodes=${c.episodes}&fates=${c.fates}`);
    if (d.epoch !== S.epoch) { // a file was truncated (resume): start over
      S.epoch = d.epoch; S.metrics = []; S.episodes.clear(); S.order = []; S.fates.clear();
      S.dirty = { charts: true, list: true, diff: true };
    }
    if (d.metrics.length) { S.metrics.push(...d.metrics); S.dirty.charts = true; }
    for (const e of d.episodes) {
      if (!S.episodes.has(e.id)) S.order.push(e.id);
      S.episodes.set(e.id, e);
    }
    for (const f of d.fates) S.fates.set(f.id, f);
    if (d.episodes.length || d.fates.length) { S.dirty.list = true; S.dirty.diff = true; }
    S.cursor = d.cursor; S.status = d.status; more = d.more;
    render();
  } catch (err) {
    $("#status").textContent = `disconnected (${err.message})`;
    $("#status").className = "status";
  }
  S.inflight = false;
  S.timer = more ? setTimeout(poll, 0) : $("#follow").checked ? setTimeout(poll, 1500) : null;
}

function render() {
  const st = S.status;
  const step = st.last_step === null || st.last_step === undefined ? "–" : st.last_step + 1;
  const parts = S.meta.kind === "run" ? [`step ${step}${st.steps ? "/" + st.steps : ""}`] : [];
  parts.push(`${S.episodes.size} episodes`);
  if (st.updated) parts.push(`updated ${Math.max(0, Math.round(Date.now() / 1000 - st.updated))}s ago`);
  if (st.behind_bytes > 0) parts.push(`reading the run: ${(st.behind_bytes / 2 ** 20).toFixed(1)} MB to go`);
  if (st.skipped_rows) parts.push(`${st.skipped_rows} unreadable row${st.skipped_rows === 1 ? "" : "s"} skipped`);
  parts.unshift(st.finished ? "finished" : "live");
  $("#status").textContent = parts.join(" · ");
  $("#status").title = st.skipped_first ? `first skipped: ${st.skipped_first}` : "";
  $("#status").className = "status" + (st.finished ? "" : " live");
  const tab = document.querySelector("nav button.active").dataset.tab;
  if (S.dirty.charts && tab === "curves") { renderFacts(); renderCharts(); S.dirty.charts = false; }
  if (S.dirty.list && tab === "episodes") { renderFilters(); renderList(); S.dirty.list = false; }
  if (S.dirty.diff && tab === "diff") { renderDiffTasks(); S.dirty.diff = false; }
}

// ------------------------------------------------------------------ curves

function renderFacts() {
  const box = $("#facts");
  box.replaceChildren();
  const facts = { ...S.meta.config };
  const sum = S.meta.summary || {};
  for (const k of ["mean_reward", "error_rate", "episodes", "version", "wall_s"]) if (k in sum) facts[k] = sum[k];
  for (const [k, v] of Object.entries(sum.pass_at || {})) facts[`pass@${k}`] = v;
  const last = S.metrics[S.metrics.length - 1];
  if (last) for (const k of ["ledger/started", "ledger/trained", "ledger/in_flight"]) if (k in last) facts[k] = last[k];
  for (const [k, v] of Object.entries(facts)) {
    if (typeof v === "object") continue;
    box.append(el("span", {}, `${k} `, el("b", {}, typeof v === "number" ? fmt(v) : v)));
  }
}

function points(s) {
  // the same points as series_points in agentrl/viewer/data.py
  const out = [];
  for (const r of S.metrics) {
    const y = num(r[s.key]);
    let x = num(r[s.x || "version"]);
    if (x === null && !s.x && num(r.step) !== null) x = r.step + 1;
    if (x !== null && y !== null) out.push([x, y]);
  }
  if (s.episodes) { // versions no row carries: the mean reward of that source's episodes (errored count 0)
    const have = new Set(out.map((p) => p[0])), sums = new Map();
    for (const e of S.episodes.values()) {
      const v = num(e.version);
      if (e.source !== s.episodes || v === null || have.has(v)) continue;
      const [n, total] = sums.get(v) || [0, 0];
      sums.set(v, [n + 1, total + (e.error ? 0 : num(e.reward) ?? 0)]);
    }
    for (const [v, [n, total]] of sums) out.push([v, total / n]);
    out.sort((a, b) => a[0] - b[0]);
  }
  return out;
}

function ticks(lo, hi, n = 4) {
  if (hi - lo < 1e-12) { hi = lo + 1; }
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
  return out;
}

function renderCharts() {
  const box = $("#charts");
  if (!S.meta.charts.length) {
    box.replaceChildren(el("p", { class: "hint" }, "An eval directory has no training curves; see Episodes."));
    return;
  }
  box.replaceChildren(...S.meta.charts.map((spec) => el("div", { class: "chart-box" }, chartSVG(spec))));
}

function chartSVG(spec) {
  const W = 380, H = 220, m = { l: 52, r: 12, t: 24, b: 36 };
  const svg = sv("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", "data-chart": spec.id });
  svg.append(sv("text", { x: m.l, y: 15, class: "title" }, spec.title));
  let series = spec.series.map((s) => ({ ...s, pts: points(s) })).filter((s) => s.pts.length)
    .map((s) => ({ ...s, last: s.pts[s.pts.length - 1][1] }));
  if (spec.stacked) series = stack(series);
  m.t = legend(svg, series, m, W) + 8;
  if (!series.length) {
    svg.append(sv("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no data yet"));
    return svg;
  }
  const xs = series.flatMap((s) => s.pts.map((p) => p[0]));
  const ys = series.flatMap((s) => s.pts.map((p) => p[1])).concat(spec.stacked ? [0] : []);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y0 > 0 && y0 < 0.5 * y1) y0 = 0;
  if (x1 - x0 < 2) { x0 -= 0.5; x1 += 0.5; } // a one-step run: its points inside the frame
  if (y1 - y0 < 1e-12) { const pad = Math.abs(y0) * 0.05 || 0.05; y0 -= pad; y1 += pad; } // one value: mid-height
  const X = (x) => m.l + ((x - x0) / (x1 - x0)) * (W - m.l - m.r);
  const Y = (y) => H - m.b - ((y - y0) / (y1 - y0)) * (H - m.t - m.b);
  for (const t of ticks(y0, y1)) {
    if (t < y0 - 1e-12 || t > y1 + 1e-12) continue;
    svg.append(sv("line", { x1: m.l, x2: W - m.r, y1: Y(t), y2: Y(t), class: "grid" }));
    svg.append(sv("text", { x: m.l - 4, y: Y(t) + 3, "text-anchor": "end" }, fmt(t)));
  }
  for (const t of ticks(x0, x1, 5)) {
    if (t < x0 || t > x1 || !Number.isInteger(t)) continue;
    svg.append(sv("text", { x: X(t), y: H - m.b + 13, "text-anchor": "middle" }, fmt(t)));
  }
  svg.append(sv("line", { x1: m.l, x2: m.l, y1: m.t, y2: H - m.b, class: "axis" }));
  svg.append(sv("line", { x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, class: "axis" }));
  svg.append(sv("text", { x: (m.l + W - m.r) / 2, y: H - 4, "text-anchor": "middle", class: "xlabel" }, S.meta.x_label));
  svg.append(sv("text", { transform: `translate(11 ${(m.t + H - m.b) / 2}) rotate(-90)`, "text-anchor": "middle",
    class: "ylabel" }, spec.y));
  for (const s of series) {
    const d = s.pts.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
    if (spec.stacked) {
      const base = s.base.map((p) => `L${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).reverse().join("");
      svg.append(sv("path", { d: d + base + "Z", fill: s.color, "fill-opacity": 0.75, stroke: "none", class: "area" }));
    }
    const path = sv("path", { d, stroke: s.color, class: "series", "data-key": s.key,
      "stroke-dasharray": s.dash ? "4 3" : "none" });
    path.append(sv("title", {}, `${s.label}: last ${fmt(s.last)}`));
    svg.append(path);
    // a line needs two points: a short series gets a dot per point, or a one-step run shows nothing
    if (s.marker || s.pts.length <= 3) {
      for (const p of s.pts) svg.append(sv("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: s.color, class: "point" }));
    }
  }
  return svg;
}

function legend(svg, series, m, W) {
  // one row per line of entries under the title ("label last-value"); returns the last row's y
  let x = m.l, y = 30;
  for (const s of series) {
    const label = `${s.label} ${fmt(s.last)}`, w = 16 + label.length * 5.6;
    if (x + w > W - m.r && x > m.l) { x = m.l; y += 12; }
    svg.append(sv("rect", { x, y: y - 8, width: 9, height: 9, fill: s.color, class: "key" }));
    svg.append(sv("text", { x: x + 12, y }, label));
    x += w + 6;
  }
  return series.length ? y : 18;
}

function stack(series) {
  // cumulative areas over the union of x; a series missing at some x counts 0 there
  const xs = [...new Set(series.flatMap((s) => s.pts.map((p) => p[0])))].sort((a, b) => a - b);
  let below = xs.map(() => 0);
  return series.map((s) => {
    const at = new Map(s.pts);
    const top = xs.map((x, i) => below[i] + (at.get(x) || 0));
    const out = { ...s, base: xs.map((x, i) => [x, below[i]]), pts: xs.map((x, i) => [x, top[i]]) };
    below = top;
    return out;
  });
}

// ------------------------------------------------------------------ episode browser

function fateOf(e) {
  const f = S.fates.get(e.id);
  return f ? f.fate : e.fate || "in flight";
}
function advantageOf(e) {
  const f = S.fates.get(e.id);
  return f && f.advantage !== null && f.advantage !== undefined ? f.advantage : null;
}

function fillSelect(sel, values) {
  const cur = sel.value, have = new Set([...sel.options].map((o) => o.value));
  for (const v of values) if (!have.has(v)) sel.append(el("option", { value: v }, v));
  sel.value = cur;
}

function renderFilters() {
  const f = $("#filters"), seen = { fate: new Set(), error_kind: new Set(), stop_reason: new Set(), source: new Set() };
  for (const e of S.episodes.values()) {
    seen.fate.add(fateOf(e));
    if (e.error_kind) seen.error_kind.add(e.error_kind);
    if (e.stop_reason) seen.stop_reason.add(e.stop_reason);
    seen.source.add(e.source);
  }
  for (const k of Object.keys(seen)) fillSelect(f.elements[k], [...seen[k]].sort());
}

function matches(e, q) {
  const r = e.reward;
  if (q.rmin !== "" && !(r !== null && r >= +q.rmin)) return false;
  if (q.rmax !== "" && !(r !== null && r <= +q.rmax)) return false;
  if (q.fate && fateOf(e) !== q.fate) return false;
  if (q.error_kind && e.error_kind !== q.error_kind) return false;
  if (q.stop_reason && e.stop_reason !== q.stop_reason) return false;
  if (q.source && e.source !== q.source) return false;
  if (q.task && !(e.question || "").toLowerCase().includes(q.task.toLowerCase()) && e.task !== q.task) return false;
  return true;
}

function renderList() {
  const q = Object.fromEntries(new FormData($("#filters")).entries());
  const rows = [];
  let n = 0;
  for (let i = S.order.length - 1; i >= 0; i--) { // newest first
    const e = S.episodes.get(S.order[i]);
    if (!matches(e, q)) continue;
    n++;
    if (rows.length >= 300) continue;
    const fate = fateOf(e);
    rows.push(el("tr", { "data-id": e.id, class: e.id === S.selected ? "selected" : null, onclick: () => openEpisode(e.id) },
      el("td", {}, fmt(e.version)), el("td", {}, e.source), el("td", { class: "q", title: e.question }, e.question),
      el("td", {}, fmt(e.reward)), el("td", {}, fmt(advantageOf(e))),
      el("td", {}, el("span", { class: `fate fate-${fate.replace(" ", "-")}` }, fate)),
      el("td", {}, e.error_kind || ""), el("td", {}, e.stop_reason || ""), el("td", {}, fmt(e.turns)),
      el("td", {}, fmt(e.tool_calls))));
  }
  $("#episodes tbody").replaceChildren(...rows);
  $("#count").textContent = `${n} of ${S.episodes.size} episodes` + (n > 300 ? " (newest 300 shown)" : "");
}

// ------------------------------------------------------------------ one episode

function messageView(m, cls) {
  const box = el("div", { class: `msg ${m.role} ${cls || ""}` },
    el("span", { class: "role" }, m.role + (m.name ? ` · ${m.name}` : "") + (m.role === "tool" ? " result" : "")));
  const content = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
  if (content) box.append(el("span", { class: "content" }, content));
  for (const c of m.tool_calls || []) {
    const fn = c.function || c;
    box.append(el("div", { class: "tool-call" }, "→ ", el("span", { class: "fn" }, fn.name), `(${fn.arguments})`));
  }
  return box;
}

function versionPalette(versions) {
  const colours = ["#a6cee3", "#fdbf6f", "#b2df8a", "#cab2d6", "#fb9a99", "#ffff99", "#1f78b4", "#33a02c"];
  const vs = [...new Set(versions)].sort((a, b) => a - b);
  return new Map(vs.map((v, i) => [v, colours[(vs.length - 1 - i) % colours.length]]));
}

function tokenView(seq, palette) {
  const box = el("div", { class: "tokens" });
  seq.ids.forEach((id, i) => {
    const sampled = seq.mask[i] === 1, lp = seq.logprobs[i], v = seq.versions[i];
    const text = (seq.text[i] || "").replace(/\n/g, "↵\n");
    // "": the first bytes of a character that a later token completes (that token shows it)
    const part = text === "" ? " · first bytes of a character the next token completes" : "";
    const span = el("span", { class: `tok ${sampled ? "sampled" : "masked"}${part ? " part" : ""}`,
      "data-lp": sampled ? lp : null, "data-version": sampled ? v : null,
      title: (sampled ? `token ${id} · logprob μ ${fmt(lp)} (p ${fmt(Math.exp(lp))}) · version ${v}`
        : `token ${id} · not trained on (prompt / env / tool tokens)`) + part }, text);
    if (sampled) {
      span.style.backgroundColor = S.colourBy === "logprob"
        ? `hsl(${(Math.exp(num(lp) ?? 0) * 120).toFixed(0)}, 75%, 78%)` : palette.get(v);
    }
    box.append(span);
  });
  return box;
}

function tokenLegend(palette) {
  if (S.colourBy === "logprob") {
    return el("div", { class: "legend" }, ...[0.05, 0.25, 0.5, 0.75, 1].map((p) =>
      el("span", {}, el("i", { style: `background:hsl(${p * 120},75%,78%)` }), `p ${p}`)),
      el("span", {}, el("i", { style: "background:#f1f1f1" }), "not trained (loss mask 0)"));
  }
  return el("div", { class: "legend" }, ...[...palette].map(([v, c]) => el("span", {}, el("i", { style: `background:${c}` }),
    `version ${v}`)), el("span", {}, el("i", { style: "background:#f1f1f1" }), "not trained (loss mask 0)"));
}

async function openEpisode(id) {
  S.selected = id;
  for (const tr of document.querySelectorAll("#episodes tbody tr")) tr.classList.toggle("selected", tr.dataset.id === id);
  const box = $("#detail");
  let ep;
  box.replaceChildren(el("p", { class: "hint" }, "loading …"));
  try { ep = await getJSON(`api/episode/${encodeURIComponent(id)}`); } catch (err) {
    box.replaceChildren(el("p", { class: "error" }, String(err))); return;
  }
  S.openEp = ep;
  renderDetail();
}

function renderDetail() {
  const ep = S.openEp, s = ep.summary, f = ep.fate, box = $("#detail");
  const adv = f && f.advantage !== null && f.advantage !== undefined
    ? `${fmt(f.advantage)}` : "not trained";
  const kv = { id: s.id, source: s.source, version: fmt(s.version), reward: fmt(ep.summary.reward), advantage: adv,
    fate: (f ? f.fate + (f.step !== null && f.step !== undefined ? ` at step ${f.step + 1}` : "") : fateOf(s)),
    "stop reason": s.stop_reason, answer: ep.answer, group: s.group };
  const versions = ep.sequences.flatMap((q) => q.versions.filter((v, i) => q.mask[i] === 1));
  const palette = versionPalette(versions);
  box.replaceChildren(...[
    el("h3", {}, s.question || s.id),
    el("div", { class: "kv" }, ...Object.entries(kv).filter(([, v]) => v !== null && v !== undefined)
      .map(([k, v]) => el("span", {}, `${k} `, el("b", {}, v)))),
    ep.error ? el("p", { class: "error" }, `${ep.error_kind || "error"}: ${ep.error}`) : null,
    ...(ep.problems || []).map((p) => el("p", { class: "error" }, `record: ${p}`)),
    el("div", { class: "toolbar" }, versionsOf(s.task) > 1
      ? el("button", { id: "compare", onclick: () => compareTask(s) }, `compare across ${versionsOf(s.task)} versions`)
      : el("span", { class: "hint" }, "this task was seen at one version only")),
    el("h4", {}, "Transcript"),
    el("div", { class: "transcript" }, ...ep.messages.map((m) => messageView(m))),
    el("div", { class: "toolbar" }, el("b", {}, "Tokens"), " colour by",
      el("button", { id: "by-logprob", class: S.colourBy === "logprob" ? "on" : null, onclick: () => recolour("logprob") },
        "logprob μ"),
      el("button", { id: "by-version", class: S.colourBy === "version" ? "on" : null, onclick: () => recolour("version") },
        "version")),
    ep.sequences.length ? tokenLegend(palette) : el("p", { class: "hint" }, "No token arrays in this record."),
    ...ep.sequences.map((q) => tokenView(q, palette)),
    el("div", { class: "kv" }, ...Object.entries(ep.metrics).map(([k, v]) => el("span", {}, `${k} `, el("b", {}, fmt(v))))),
  ].filter(Boolean));
}

function versionsOf(task) {
  const vs = new Set();
  for (const e of S.episodes.values()) if (e.task === task) vs.add(e.version);
  return vs.size;
}

function recolour(by) { S.colourBy = by; renderDetail(); }

// ------------------------------------------------------------------ diff: one task at two versions

function tasksAcrossVersions() {
  const byTask = new Map();
  for (const e of S.episodes.values()) {
    if (!byTask.has(e.task)) byTask.set(e.task, []);
    byTask.get(e.task).push(e);
  }
  const out = [];
  for (const [key, eps] of byTask) {
    const versions = new Set(eps.map((e) => e.version));
    if (versions.size < 2) continue;
    eps.sort((a, b) => (a.version ?? 0) - (b.version ?? 0));
    out.push({ key, eps, versions: versions.size, eval: eps.some((e) => e.source === "eval") });
  }
  return out.sort((a, b) => (b.eval - a.eval) || (b.versions - a.versions)).slice(0, 500);
}

function renderDiffTasks(pick) {
  const sel = $("#diff-task"), tasks = tasksAcrossVersions(), cur = pick || sel.value;
  S.diffTasks = new Map(tasks.map((t) => [t.key, t]));
  sel.replaceChildren(...tasks.map((t) => el("option", { value: t.key },
    `${t.eps[0].question.slice(0, 60)} (${t.versions} versions)`)));
  $("#diff-note").textContent = tasks.length ? "" : "No task seen at two versions yet (held-out episodes are, at every eval).";
  if (!tasks.length) return;
  sel.value = S.diffTasks.has(cur) ? cur : tasks[0].key;
  if (sel.value !== S.diffShown || pick) renderDiffEpisodes();
}

function renderDiffEpisodes(pickB) {
  const t = S.diffTasks.get($("#diff-task").value);
  if (!t) return;
  S.diffShown = t.key;
  const opts = () => t.eps.map((e) => el("option", { value: e.id },
    `v${fmt(e.version)} · ${e.source} · reward ${fmt(e.reward)}`));
  $("#diff-a").replaceChildren(...opts());
  $("#diff-b").replaceChildren(...opts());
  const first = t.eps[0].id, last = t.eps[t.eps.length - 1].id;
  $("#diff-b").value = pickB || last;
  $("#diff-a").value = $("#diff-b").value === first ? last : first;
  renderDiff();
}

async function renderDiff() {
  const [a, b] = await Promise.all([$("#diff-a").value, $("#diff-b").value].map((id) => getJSON(`api/episode/${encodeURIComponent(id)}`)));
  const text = (m) => (typeof m.content === "string" ? m.content : JSON.stringify(m.content)) +
    (m.tool_calls || []).map((c) => `\n→ ${(c.function || c).name}(${(c.function || c).arguments})`).join("");
  const side = (ep, other, keep) => {
    const s = ep.summary;
    return [el("h3", {}, `version ${fmt(s.version)} · reward ${fmt(s.reward)}`),
      el("div", { class: "kv" }, el("span", {}, "source ", el("b", {}, s.source)), el("span", {}, "fate ", el("b", {}, fateOf(s))),
        el("span", {}, "stop ", el("b", {}, s.stop_reason || "–"))),
      ...ep.messages.map((m, i) => {
        const o = other.messages[i], mine = text(m), theirs = o ? text(o) : null;
        if (theirs === mine) return messageView(m, "same");
        const box = el("div", { class: `msg ${m.role} changed` }, el("span", { class: "role" }, m.role));
        box.append(...wordDiff(theirs || "", mine, keep));
        return box;
      })];
  };
  $("#diff-left").replaceChildren(...side(a, b, "del"));
  $("#diff-right").replaceChildren(...side(b, a, "ins"));
}

function wordDiff(from, to, mark) {
  // LCS over words: show `to`, marking words that `from` lacks (ins on the right, del on the left)
  const A = from.split(/(\s+|[^\w\s])/).filter(Boolean), B = to.split(/(\s+|[^\w\s])/).filter(Boolean);
  if (A.length * B.length > 4e6) return [el(mark, {}, to)];
  const L = Array.from({ length: A.length + 1 }, () => new Uint16Array(B.length + 1));
  for (let i = A.length - 1; i >= 0; i--) for (let j = B.length - 1; j >= 0; j--)
    L[i][j] = A[i] === B[j] ? L[i + 1][j + 1] + 1 : Math.max(L[i + 1][j], L[i][j + 1]);
  const out = [];
  let i = 0, j = 0;
  while (j < B.length) {
    if (i < A.length && A[i] === B[j]) { out.push(B[j]); i++; j++; }
    else if (i < A.length && L[i + 1][j] >= L[i][j + 1]) i++;
    else { out.push(el(mark, {}, B[j])); j++; }
  }
  return out;
}

function compareTask(s) {
  showTab("diff");
  renderDiffTasks(s.task);
  if (S.diffTasks.has(s.task)) renderDiffEpisodes(s.id);
}

// ------------------------------------------------------------------ start

function showTab(name) {
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.dataset.tab === name);
  for (const sec of document.querySelectorAll("main > section")) sec.hidden = sec.id !== `tab-${name}`;
  S.dirty = { charts: true, list: true, diff: name === "diff" ? S.dirty.diff : true };
  render();
}

async function start() {
  S.meta = await getJSON("api/meta");
  document.title = `agentrl · ${S.meta.name}`;
  $("#run-name").textContent = `${S.meta.name} (${S.meta.kind})`;
  for (const b of document.querySelectorAll("nav button")) b.addEventListener("click", () => showTab(b.dataset.tab));
  for (const f of S.meta.fates) fillSelect($("#filters").elements.fate, [f]);
  $("#filters").addEventListener("input", renderList);
  $("#filters").addEventListener("submit", (ev) => ev.preventDefault());
  $("#diff-task").addEventListener("change", () => renderDiffEpisodes());
  $("#diff-a").addEventListener("change", renderDiff);
  $("#diff-b").addEventListener("change", renderDiff);
  $("#follow").addEventListener("change", () => { if ($("#follow").checked) poll(); });
  if (S.meta.kind !== "run") showTab("episodes");
  poll();
}

start();
