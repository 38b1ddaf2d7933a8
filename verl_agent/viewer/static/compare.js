// Two trajectories of the same prompt (e.g. step A vs step B) aligned turn by turn.
// renderAligned(a, b, labels) -> a DOM table: the outcome row (reward, outcome, stop reason, turns), the prompt
// (once, or both when they differ), then one row per assistant turn: what each side said and called, what came
// back, and the per-turn score with its difference. Cells whose values differ carry the class "diff"
// (plus "better"/"worse" for B relative to A); a turn only one side has is "missing" on the other.
"use strict";

function splitTurns(rec) {
  const msgs = rec.messages || [], info = rec.turns || [];
  const first = msgs.findIndex((m) => m.role === "assistant");
  const prompt = first < 0 ? msgs : msgs.slice(0, first), turns = [];
  for (const m of first < 0 ? [] : msgs.slice(first)) {
    if (m.role === "assistant") turns.push({ msg: m, obs: [], info: info[turns.length] || null });
    else turns[turns.length - 1].obs.push(m);
  }
  // a last turn cut by the budget may be in `turns` without its message
  for (let k = turns.length; k < info.length; k++) turns.push({ msg: null, obs: [], info: info[k] });
  return { prompt, turns };
}

function callKey(m) {
  return JSON.stringify((m && m.tool_calls || []).map((c) => [c.function?.name, c.function?.arguments]));
}

function signed(d) { return (d > 0 ? "+" : "") + fmt(d); }

function deltaCell(va, vb, label) {
  const cls = va === vb ? "delta" : `delta diff ${vb > va ? "better" : "worse"}`;
  return h("td", { class: cls }, va === vb ? "=" : `${label} ${signed(vb - va)}`);
}

function turnCell(t, k, rec) {
  if (!t) return h("td", { class: "missing" }, `no turn ${k + 1} (stopped: ${rec.stop_reason})`);
  const m = t.msg || { content: "(no message recorded)" };
  return h("td", { class: "turn-cell" },
    h("div", { class: "turn-info" }, `score ${fmt(t.info ? t.info.score : 0)}` +
      (t.info && t.info.num_tool_calls ? ` · ${t.info.num_tool_calls} tool call(s)` : "")),
    reasoningEl(m),
    m.content ? h("pre", { class: "content" }, m.content) : null,
    (m.tool_calls || []).map(toolCallEl),
    t.obs.map((o) => h("div", { class: `obs role-${o.role}` },
      h("b", {}, o.role === "tool" ? `tool result${o.name ? ` (${o.name})` : ""}` : "feedback"), " ",
      h("pre", { class: "content" }, o.content || ""))));
}

function renderAligned(a, b, labels) {
  const A = splitTurns(a), B = splitTurns(b);
  const row = (cls, head, ...cells) => h("tr", { class: cls }, h("th", {}, head), ...cells);
  const same = (x, y) => h("td", { class: x === y ? "" : "diff" }, String(y));
  const ra = typeof a.reward === "number" ? a.reward : 0, rb = typeof b.reward === "number" ? b.reward : 0;
  const rows = [
    h("tr", {}, h("th", {}, ""), h("th", {}, labels[0]), h("th", {}, labels[1]), h("th", {}, "B − A")),
    row("cmp-outcome", "reward", h("td", {}, fmt(ra)), h("td", { class: ra === rb ? "" : "diff" }, fmt(rb)),
      deltaCell(ra, rb, "reward")),
    row("cmp-outcome", "outcome", h("td", {}, outcomeBadge(a)), h("td", { class: (a.outcome || "ok") === (b.outcome || "ok")
      && a.cause === b.cause ? "" : "diff" }, outcomeBadge(b)), h("td", {})),
    row("cmp-outcome", "stop reason", h("td", {}, String(a.stop_reason)), same(a.stop_reason, b.stop_reason), h("td", {})),
    row("cmp-outcome", "turns", h("td", {}, String(A.turns.length)), same(A.turns.length, B.turns.length),
      deltaCell(A.turns.length, B.turns.length, "turns")),
  ];
  const pa = JSON.stringify(A.prompt), pb = JSON.stringify(B.prompt);
  const promptText = (p) => p.map((m) => `${m.role}: ${m.content || ""}`).join("\n");
  rows.push(pa === pb
    ? row("cmp-prompt", "prompt", h("td", { colspan: 2 }, h("pre", { class: "content" }, promptText(A.prompt))), h("td", {}))
    : row("cmp-prompt", "prompt", h("td", {}, h("pre", { class: "content" }, promptText(A.prompt))),
      h("td", { class: "diff" }, h("pre", { class: "content" }, promptText(B.prompt))), h("td", {}, "prompts differ")));
  for (let k = 0; k < Math.max(A.turns.length, B.turns.length); k++) {
    const ta = A.turns[k], tb = B.turns[k];
    const sa = ta && ta.info ? ta.info.score : 0, sb = tb && tb.info ? tb.info.score : 0;
    const tr = h("tr", { class: "cmp-turn", "data-turn": k + 1 }, h("th", {}, `turn ${k + 1}`),
      turnCell(ta, k, a), turnCell(tb, k, b),
      ta && tb ? deltaCell(sa, sb, "score") : h("td", { class: "delta diff" }, ta ? "only A" : "only B"));
    if (ta && tb && callKey(ta.msg) !== callKey(tb.msg)) tr.children[2].classList.add("calls-differ");
    rows.push(tr);
  }
  return h("table", { class: "cmp-table" }, h("tbody", {}, rows));
}

window.renderAligned = renderAligned;
