// The viewer page: learning curves, step browser, one trajectory, and two steps side by side.
"use strict";

const CHARTS = [
  ["Reward", ["rollout/reward/mean", "val/reward/mean"]],
  ["Success rate", ["rollout/success_rate", "val/success_rate"]],
  ["Response length", ["rollout/response_length/mean", "val/response_length/mean"]],
  ["Entropy", ["actor/entropy"]],
  ["KL", ["actor/kl", "actor/ppo_kl", "actor/kl_loss"]],
  ["Time per phase (s)", (keys) => keys.filter((k) => k.startsWith("time/"))],
  // a share (0..1) and counts never share an axis
  ["Infrastructure failures (share)", ["rollout/infra_failed", "val/infra_failed"]],
  ["Infrastructure failures by cause (count)", (keys) => keys.filter((k) => k.startsWith("rollout/infra_failed/"))],
];
const PAGE = 50, POLL_MS = 3000;
const state = { xrange: null, metricsSig: null, extra: [], file: null, offset: 0, selected: null };
const $ = (sel) => document.querySelector(sel);

function showError(where, msg) {
  const box = $(where);
  box.replaceChildren(...(msg ? [h("div", { class: "error" }, msg)] : []));
}

async function guard(where, fn) {
  try { await fn(); } catch (e) { showError(where, String(e.message || e)); console.error(e); }
}

// ---- learning curves ---------------------------------------------------------------------------
function renderCurves(m) {
  const box = $("#charts");
  box.replaceChildren();
  const pick = $("#metric-pick");
  if (pick.options.length !== m.keys.length + 1)
    pick.replaceChildren(h("option", { value: "" }, "add a chart…"), ...m.keys.map((k) => h("option", { value: k }, k)));
  const charts = CHARTS.map(([title, sel]) => [title, typeof sel === "function" ? sel(m.keys) : sel])
    .concat(state.extra.map((k) => [k, [k]]));
  for (const [title, keys] of charts) {
    const series = keys.filter((k) => m.keys.includes(k))
      .map((k) => ({ name: k, points: m.rows.filter((r) => k in r).map((r) => [r.step, r[k]]) }));
    if (!series.length) continue;
    const cell = h("div", { class: "chart-cell" });
    box.appendChild(cell);
    lineChart(cell, { title, series, xrange: state.xrange, onZoom: (r) => { state.xrange = r; renderCurves(m); } });
  }
  if (!box.children.length) box.appendChild(h("p", { class: "muted" }, "no metrics.jsonl rows yet"));
  $("#zoom-note").textContent = state.xrange ? `steps ${fmt(state.xrange[0], 1)}–${fmt(state.xrange[1], 1)} (double-click a chart to reset)`
    : "drag across a chart to zoom";
  $("#metrics-errors").replaceChildren(...m.errors.map((e) => h("div", { class: "error" }, e.error)));
}

async function refreshMetrics(force) {
  const m = await Api.metrics();
  const sig = `${m.rows.length}:${JSON.stringify(m.rows[m.rows.length - 1] || {})}:${m.errors.length}`;
  if (force || sig !== state.metricsSig) { state.metricsSig = sig; state.metrics = m; renderCurves(m); }
  $("#steps-count").textContent = `${m.steps} training step${m.steps === 1 ? "" : "s"} logged`;
}

// ---- step browser -----------------------------------------------------------------------------
function filters() {
  return { file: state.file, offset: state.offset, limit: PAGE, status: $("#f-status").value, cause: $("#f-cause").value,
    min_reward: $("#f-min").value, max_reward: $("#f-max").value, tool: $("#f-tool").value, text: $("#f-text").value.trim() };
}

function fillSelect(sel, counts, allLabel) {
  const cur = sel.value;
  sel.replaceChildren(h("option", { value: "" }, allLabel),
    ...Object.entries(counts).map(([k, n]) => h("option", { value: k }, `${k} (${n})`)));
  sel.value = [...sel.options].some((o) => o.value === cur) ? cur : "";
}

async function loadFiles() {
  const info = await Api.run();
  $("#run-name").textContent = info.name;
  const sel = $("#f-file"), cur = sel.value;
  sel.replaceChildren(...info.files.map((f) => h("option", { value: f.id },
    f.kind === "other" ? f.id : `${f.kind === "val" ? "validation" : "step"} ${f.step}`)));
  for (const s of ["#cmp-a", "#cmp-b"]) {
    const keep = $(s).value;
    $(s).replaceChildren(...[...sel.options].map((o) => o.cloneNode(true)));
    if (keep) $(s).value = keep;
  }
  if (cur && info.files.some((f) => f.id === cur)) sel.value = cur;
  if (!state.file && info.files.length) { state.file = info.files[0].id; sel.value = state.file; }
  return info;
}

function rowEl(r) {
  if (r.error && !r.uid) return h("tr", { class: "row-error" }, h("td", {}, r.line), h("td", { colspan: 6, class: "error" }, r.error));
  return h("tr", { class: "traj-row", "data-index": r.index, onclick: () => openTrajectory(state.file, r.index) },
    h("td", {}, r.line), h("td", { class: "uid" }, r.uid), h("td", {}, fmt(r.reward)), h("td", {}, outcomeBadge(r)),
    h("td", {}, r.stop_reason), h("td", {}, `${r.num_turns} / ${(r.tools || []).join(", ")}`),
    h("td", { class: "prompt" }, r.prompt || ""));
}

async function loadRecords() {
  if (!state.file) { $("#list").replaceChildren(h("p", { class: "muted" }, "no trajectory files in this run yet")); return; }
  showError("#list-error", null);
  const seq = (state.seq = (state.seq || 0) + 1);
  const res = await Api.records(filters());
  if (seq !== state.seq) return; // a newer query (the user kept typing) owns the list
  fillSelect($("#f-cause"), res.facets.causes, "any cause");
  const st = $("#f-status"), cur = st.value, sc = res.facets.status;
  st.replaceChildren(h("option", { value: "" }, `all (${res.total})`),
    ...["ok", "policy_failure", "infra_failure", "filtered", "truncated", "error"].map((k) =>
      h("option", { value: k }, `${k === "ok" ? "success (ok)" : k} (${sc[k] || 0})`)));
  st.value = cur;
  $("#list").replaceChildren(h("table", { class: "traj-table" },
    h("thead", {}, h("tr", {}, ...["line", "uid", "reward", "outcome", "stop", "turns / tools", "prompt"].map((c) => h("th", {}, c)))),
    h("tbody", {}, res.items.map(rowEl))));
  $("#page-info").textContent = `${res.matched ? res.offset + 1 : 0}–${res.offset + res.items.length} of ${res.matched}` +
    (res.matched !== res.total ? ` (filtered from ${res.total})` : "") + (res.truncated_to ? ` · report holds ${res.truncated_to}` : "");
  $("#file-errors").replaceChildren(...res.errors.map((e) => h("div", { class: "error line-error" }, `${state.file}: ${e.error}`)));
  $("#prev").disabled = res.offset === 0;
  $("#next").disabled = res.offset + res.items.length >= res.matched;
  if (res.complete === false) { // a large file is indexed a slice per request: show what is there, ask again
    $("#page-info").textContent += ` · indexing ${Math.floor((100 * res.indexed_bytes) / res.bytes)}%…`;
    setTimeout(() => { if (seq === state.seq) guard("#list-error", loadRecords); }, 50);
  }
}

async function loadTools() {
  fillSelect($("#f-tool"), await Api.tools(state.file), "any tool");
}

async function openTrajectory(file, index) {
  state.selected = { file, index };
  document.querySelectorAll(".traj-row.sel").forEach((r) => r.classList.remove("sel"));
  document.querySelector(`.traj-row[data-index="${index}"]`)?.classList.add("sel");
  const pane = $("#detail");
  pane.replaceChildren(h("p", { class: "muted" }, "loading…"));
  try {
    const rec = await Api.record(file, index);
    pane.replaceChildren(renderTrajectory(rec, { onCompare: startCompare }));
  } catch (e) {
    pane.replaceChildren(h("div", { class: "error" }, `cannot show record ${index} of ${file}: ${e.message}`));
  }
}

// ---- compare two steps --------------------------------------------------------------------------
async function startCompare(rec) {
  state.cmpUid = rec.uid;
  const files = [...$("#cmp-a").options].map((o) => o.value);
  const i = files.indexOf(rec._file);
  $("#cmp-a").value = rec._file;
  $("#cmp-b").value = files[i + 1] ?? files[Math.max(0, i - 1)];
  showTab("compare");
  await renderCompare();
}

async function pickSide(file, col) {
  const idx = await Api.find(file, state.cmpUid);
  if (!idx.length) { col.replaceChildren(h("p", { class: "muted" }, `prompt ${state.cmpUid} is not in ${file}`)); return null; }
  const pick = h("select", { class: "cmp-sample" }, idx.map((i, k) => h("option", { value: i }, `sample ${k + 1} of ${idx.length}`)));
  pick.addEventListener("change", () => guard("#cmp-error", renderAlignedPair));
  col.replaceChildren(h("div", {}, h("b", {}, file), " ", pick), h("div", { class: "cmp-full" }));
  return pick;
}

async function renderAlignedPair() {
  const sides = [[$("#cmp-a").value, $("#cmp-left")], [$("#cmp-b").value, $("#cmp-right")]];
  const picks = sides.map(([, col]) => col.querySelector(".cmp-sample"));
  if (picks.some((p) => !p)) { $("#cmp-aligned").replaceChildren(); return; }
  const recs = await Promise.all(sides.map(([file], i) => Api.record(file, +picks[i].value)));
  sides.forEach(([, col], i) => col.querySelector(".cmp-full").replaceChildren(
    h("details", {}, h("summary", {}, "whole trajectory with tokens"), renderTrajectory(recs[i]))));
  const label = (i) => `${sides[i][0]} · ${picks[i].selectedOptions[0].textContent}`;
  $("#cmp-aligned").replaceChildren(renderAligned(recs[0], recs[1], [label(0), label(1)]));
}

async function renderCompare() {
  $("#cmp-uid").textContent = state.cmpUid ? `prompt ${state.cmpUid}` : "open a trajectory and press “compare” first";
  if (!state.cmpUid) return;
  showError("#cmp-error", null);
  await Promise.all([pickSide($("#cmp-a").value, $("#cmp-left")), pickSide($("#cmp-b").value, $("#cmp-right"))]);
  await renderAlignedPair();
}

// ---- wiring ------------------------------------------------------------------------------------
function showTab(name) {
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t.dataset.tab === name));
  document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== `view-${name}`; });
}

function wire() {
  document.querySelectorAll(".tab").forEach((t) => t.addEventListener("click", () => showTab(t.dataset.tab)));
  const reload = () => { state.offset = 0; guard("#list-error", loadRecords); };
  for (const id of ["#f-status", "#f-cause", "#f-tool"]) $(id).addEventListener("change", reload);
  for (const id of ["#f-min", "#f-max", "#f-text"]) $(id).addEventListener("input", reload);
  $("#f-file").addEventListener("change", () => {
    state.file = $("#f-file").value; state.offset = 0;
    guard("#list-error", async () => { await loadRecords(); await loadTools(); });
  });
  $("#prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); guard("#list-error", loadRecords); });
  $("#next").addEventListener("click", () => { state.offset += PAGE; guard("#list-error", loadRecords); });
  $("#metric-pick").addEventListener("change", (e) => {
    if (e.target.value && !state.extra.includes(e.target.value)) state.extra.push(e.target.value);
    e.target.value = ""; renderCurves(state.metrics);
  });
  for (const id of ["#cmp-a", "#cmp-b"]) $(id).addEventListener("change", () => guard("#cmp-error", renderCompare));
}

async function main() {
  wire();
  showTab("curves");
  await guard("#global-error", async () => {
    await refreshMetrics(true);
    await loadFiles();
    await loadRecords();
    await loadTools();
  });
  document.body.dataset.ready = "1";
  if (!window.VIEWER_DATA) setInterval(() => guard("#global-error", async () => {
    await refreshMetrics(false);
    await loadFiles();
    showError("#global-error", null);
  }), POLL_MS);
}

main();
