// Data access for the page: the server's JSON API, or -- in a report written by `verl-agent view --html` --
// the same answers computed from the data embedded in window.VIEWER_DATA. The filter rules mirror
// verl_agent/viewer/query.py; keep the two in step.
"use strict";

const TRUNCATED_STOPS = new Set(["response_budget", "engine_length", "max_assistant_turns", "max_user_turns",
  "max_tokens_per_turn", "max_total_tokens", "max_context_length"]);

class ApiError extends Error {}

const RemoteApi = {
  async get(path, params) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(params || {})) if (v !== null && v !== undefined && v !== "") q.set(k, v);
    const resp = await fetch(`api/${path}?${q}`);
    const body = await resp.json().catch(() => ({ detail: `HTTP ${resp.status} (not JSON)` }));
    if (!resp.ok) throw new ApiError(typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail));
    return body;
  },
  run() { return this.get("run"); },
  metrics() { return this.get("metrics"); },
  records(params) { return this.get("records", params); },
  tools(file) { return this.get("tools", { file }); },
  record(file, index) { return this.get("record", { file, index }); },
  find(file, uid) { return this.get("find", { file, uid }); },
};

function matchHead(row, f) {
  if (f.status === "error") return !!row.error;
  if (row.error) return !f.status && !f.cause && !f.tool && !f.text && f.uid === undefined;
  if (f.status === "truncated") { if (!TRUNCATED_STOPS.has(row.stop_reason)) return false; }
  else if (f.status && (row.outcome || "ok") !== f.status) return false;
  if (f.cause && row.cause !== f.cause) return false;
  if (f.uid !== undefined && row.uid !== f.uid) return false;
  const r = typeof row.reward === "number" ? row.reward : 0;
  if (f.min_reward !== undefined && f.min_reward !== "" && r < +f.min_reward) return false;
  if (f.max_reward !== undefined && f.max_reward !== "" && r > +f.max_reward) return false;
  if (f.tool && !(row.tools || []).includes(f.tool)) return false;
  return !f.text || (row.text || "").includes(f.text.toLowerCase());
}

function localFacets(rows) {
  const status = {}, causes = {};
  for (const r of rows) {
    if (r.error) { status.error = (status.error || 0) + 1; continue; }
    const o = r.outcome || "ok";
    status[o] = (status[o] || 0) + 1;
    if (TRUNCATED_STOPS.has(r.stop_reason)) status.truncated = (status.truncated || 0) + 1;
    if (r.cause) causes[r.cause] = (causes[r.cause] || 0) + 1;
  }
  return { status, causes };
}

function makeLocalApi(data) {
  const file = (id) => {
    const f = data.files[id];
    if (!f) throw new ApiError(`no trajectory file '${id}' in this report`);
    return f;
  };
  const strip = ({ text, ...row }) => row;
  return {
    async run() { return data.run; },
    async metrics() { return data.metrics; },
    async records(p) {
      const f = file(p.file), rows = f.rows.filter((r) => matchHead(r, p));
      const off = +p.offset || 0, lim = +p.limit || 50;
      return { file: p.file, total: f.total, matched: rows.length, offset: off, facets: localFacets(f.rows),
        items: rows.slice(off, off + lim).map(strip), errors: f.errors, truncated_to: f.rows.length };
    },
    async tools(id) {
      const out = {};
      for (const r of file(id).rows) for (const t of r.tools || []) out[t] = (out[t] || 0) + 1;
      return out;
    },
    async record(id, index) {
      const rec = file(id).records[index];
      if (!rec) throw new ApiError(`record ${index} of ${id} is not in this report`);
      if (rec._error) throw new ApiError(rec._error);
      return rec;
    },
    async find(id, uid) { return file(id).rows.filter((r) => r.uid === uid && !r.error).map((r) => r.index); },
  };
}

window.Api = window.VIEWER_DATA ? makeLocalApi(window.VIEWER_DATA) : RemoteApi;
