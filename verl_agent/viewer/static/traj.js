// One trajectory: header, the conversation turn by turn, and the token view.
// renderTrajectory(rec) -> a DOM element; rec is a record of verl_agent/rollout/records.py plus
// prompt_tokens/response_tokens (one decoded string per id, or null without a tokenizer).
"use strict";

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined && c !== false)
    el.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
  return el;
}

function fmt(v, d = 3) { return typeof v === "number" ? +v.toFixed(d) + "" : String(v); }

function outcomeBadge(rec) {
  const o = rec.outcome || "ok";
  return h("span", { class: `badge o-${o}` }, o + (rec.cause ? `: ${rec.cause}` : ""));
}

function renderHeader(rec) {
  return h("div", { class: "traj-head" },
    h("span", { class: "uid" }, rec.uid),
    h("span", { class: "reward" }, `reward ${fmt(rec.reward)}`), outcomeBadge(rec),
    h("span", { class: "stop" }, `stop: ${rec.stop_reason}`),
    segmentOf(rec) ? h("span", { class: "badge segment" }, `segment ${segmentOf(rec).k + 1} of ${segmentOf(rec).n}`) : null,
    h("span", {}, `policy v${rec.policy_version ?? "?"}`),
    rec._line ? h("span", { class: "muted" }, `line ${rec._line}`) : null,
    rec.error ? h("div", { class: "error" }, `error: ${rec.error}`) : null);
}

function toolCallEl(call) {
  const fn = call.function || {};
  const args = typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments, null, 2);
  return h("div", { class: "tool-call" },
    h("div", {}, h("span", { class: "label" }, "tool call "), h("code", { class: "tool-name" }, fn.name),
      call.id ? h("span", { class: "muted" }, ` id ${call.id}`) : null),
    h("pre", { class: "tool-args" }, args));
}

// An assistant turn's reasoning (<think> block, harmony's analysis channel), folded: its tokens are in the token view.
function reasoningEl(m) {
  const r = m && m.reasoning_content;
  if (!r) return null;
  return h("details", { class: "reasoning" },
    h("summary", {}, `reasoning (${r.length} characters)`), h("pre", { class: "reasoning-text" }, r));
}

// {k, n} when the episode's context was rewritten (rec is segment k of n: rollout/context.py), else null.
function segmentOf(rec) {
  const m = rec.metrics || {};
  return m.num_segments > 1 ? { k: m.segment || 0, n: m.num_segments } : null;
}

function renderConversation(rec) {
  const turns = rec.turns || [];
  let assistantSeen = 0;
  const box = h("div", { class: "conversation" });
  const seg = segmentOf(rec);
  if (seg && seg.k > 0) box.appendChild(h("div", { class: "msg rewrite-line" },
    `context rewritten: segment ${seg.k + 1} of ${seg.n} starts from the history below (${(rec.prompt_ids || []).length} ` +
    "prompt tokens); earlier turns are in the episode's other segments (same uid)"));
  for (const m of rec.messages || []) {
    let label = m.role, cls = `msg role-${m.role}`, extra = null;
    if (m.role === "assistant") {
      const t = turns[assistantSeen];
      // what the model saw when it wrote this turn: the prompt and the response up to the turn's first token
      const saw = t ? (rec.prompt_ids || []).length + t.gen_start : 0;
      extra = t ? h("span", { class: "turn-info" }, `turn ${assistantSeen + 1} · saw ${saw} tokens · score ${fmt(t.score)} · ` +
        `gen ${fmt(t.gen_seconds, 2)} s` + (t.num_tool_calls ? ` · tools ${fmt(t.tool_seconds, 2)} s` : "")) : null;
      assistantSeen += 1;
    } else if (m.role === "tool") {
      label = "tool result" + (m.name ? ` (${m.name})` : "");
    } else if (m.role === "user" && assistantSeen > 0) {
      label = "feedback (user / interaction)"; cls += " feedback";
    }
    box.appendChild(h("div", { class: cls },
      h("div", { class: "msg-head" }, h("b", {}, label), extra,
        m.tool_call_id ? h("span", { class: "muted" }, ` for ${m.tool_call_id}`) : null),
      reasoningEl(m),
      m.content ? h("pre", { class: "content" }, m.content) : null,
      (m.tool_calls || []).map(toolCallEl)));
  }
  box.appendChild(h("div", { class: "msg stop-line" }, `stop reason: ${rec.stop_reason}` +
    (rec.stop_reason === "context_rewrite" && seg ? ` (the episode goes on in segment ${seg.k + 2} of ${seg.n})` : "")));
  return box;
}

function tokenTip() {
  let tip = document.getElementById("tok-tip");
  if (!tip) { tip = h("div", { id: "tok-tip", class: "tok-tip" }); document.body.appendChild(tip); }
  return tip;
}

function logprobColor(lp) {
  const p = Math.exp(Math.max(-20, Math.min(0, lp)));   // probability 0..1: red (unlikely) to green (certain)
  return `hsl(${Math.round(p * 120)}, 75%, 80%)`;
}

// Diverging scale for advantages: red below 0, white at 0, blue above; `scale` is the record's largest |advantage|.
function advantageColor(a, scale) {
  const x = Math.max(-1, Math.min(1, a / (scale || 1)));
  return x >= 0 ? `hsl(215, 85%, ${Math.round(100 - 42 * x)}%)` : `hsl(0, 85%, ${Math.round(100 + 42 * x)}%)`;
}

function tokenSpan(id, text, info, mode) {
  const shown = text === null || text === undefined ? `[${id}]` : text.replace(/\n/g, "↵\n");
  const span = h("span", { class: `tok ${info.mask === 1 ? "m1" : "m0"}`, "data-id": id, "data-pos": info.pos }, shown);
  if (mode === "logprob" && info.mask === 1 && typeof info.lp === "number") span.style.background = logprobColor(info.lp);
  if (mode === "advantage" && info.mask === 1 && typeof info.adv === "number") span.style.background = advantageColor(info.adv, info.scale);
  span._info = { id, text, ...info };
  return span;
}

function showTip(evt) {
  const s = evt.target.closest(".tok");
  const tip = tokenTip();
  if (!s) { tip.style.display = "none"; return; }
  const i = s._info;
  tip.textContent = `id ${i.id} · ${i.where} pos ${i.pos}` + (i.mask !== undefined ? ` · mask ${i.mask}` : "") +
    (typeof i.lp === "number" ? ` · logprob ${i.lp}` : "") + (typeof i.adv === "number" ? ` · advantage ${i.adv}` : "") +
    (i.text != null ? ` · ${JSON.stringify(i.text)}` : "");
  tip.style.display = "block";
  tip.style.left = `${evt.pageX + 12}px`; tip.style.top = `${evt.pageY + 14}px`;
}

function renderTokens(rec, mode) {
  const wrap = h("div", { class: "tokens" });
  const ptoks = rec.prompt_tokens, rtoks = rec.response_tokens;
  const prompt = h("div", { class: "tok-prompt" });
  (rec.prompt_ids || []).forEach((id, pos) => prompt.appendChild(tokenSpan(id, ptoks && ptoks[pos], { pos, where: "prompt" }, mode)));
  wrap.appendChild(h("details", {}, h("summary", {}, `prompt: ${(rec.prompt_ids || []).length} tokens (not trained)`), prompt));
  const resp = h("div", { class: "tok-response" });
  const starts = new Map((rec.turns || []).map((t, k) => [t.gen_start, { k, t }]));
  const mask = rec.loss_mask || [], lps = rec.rollout_logprobs || [], advs = rec.advantages || [];
  const scale = advantageScale(rec);
  (rec.response_ids || []).forEach((id, pos) => {
    if (starts.has(pos)) {
      const { k, t } = starts.get(pos);
      resp.appendChild(h("span", { class: "turn-mark" }, `turn ${k + 1} · score ${fmt(t.score)}`));
    }
    resp.appendChild(tokenSpan(id, rtoks && rtoks[pos],
      { pos, where: "response", mask: mask[pos], lp: lps[pos], adv: mask[pos] === 1 ? advs[pos] : undefined, scale }, mode));
  });
  wrap.appendChild(resp);
  for (const el of [prompt, resp]) {
    el.addEventListener("mouseover", showTip);
    el.addEventListener("mousemove", showTip);
    el.addEventListener("mouseleave", () => { tokenTip().style.display = "none"; });
  }
  return wrap;
}

function advantageScale(rec) {
  let m = 0;
  (rec.advantages || []).forEach((a, i) => { if (rec.loss_mask && rec.loss_mask[i] === 1) m = Math.max(m, Math.abs(a)); });
  return m;
}

function legend(rec, mode) {
  const row = h("div", { class: "legend-row" });
  if (mode === "advantage") {
    const s = advantageScale(rec);
    row.append(h("span", { class: "tok", style: `background:${advantageColor(-s, s)}` }, `advantage ${fmt(-s)}`), " ",
      h("span", { class: "tok", style: "background:#fff" }, "0"), " ",
      h("span", { class: "tok", style: `background:${advantageColor(s, s)}` }, `+${fmt(s)}`), " ",
      h("span", { class: "tok m0" }, "not trained (mask 0)"));
  } else if (mode === "logprob") {
    row.append(h("span", { class: "tok", style: `background:${logprobColor(-5)}` }, "unlikely"), " ",
      h("span", { class: "tok", style: `background:${logprobColor(0)}` }, "certain (p = 1)"), " ",
      h("span", { class: "tok m0" }, "not trained (mask 0)"));
  } else {
    row.append(h("span", { class: "tok m1" }, rec.in_loss === false ? "generated (mask 1; not in the loss)" : "trained (mask 1)"), " ",
      h("span", { class: "tok m0" }, "not trained (mask 0: tool results, feedback, template)"));
  }
  return row;
}

function renderTrajectory(rec, opts = {}) {
  const out = h("div", { class: "trajectory", "data-uid": rec.uid });
  out.appendChild(renderHeader(rec));
  if (opts.onCompare) out.appendChild(h("button", { class: "compare-btn", onclick: () => opts.onCompare(rec) },
    "compare this prompt with another step"));
  out.appendChild(h("h3", {}, "Conversation"));
  out.appendChild(renderConversation(rec));
  const nTrained = (rec.loss_mask || []).filter((m) => m === 1).length;
  const tokBox = h("div", {});
  const draw = (m) => tokBox.replaceChildren(legend(rec, m), renderTokens(rec, m));
  const hasAdv = Array.isArray(rec.advantages) && rec.advantages.length === (rec.response_ids || []).length;
  const mode = h("select", { class: "tok-mode", onchange: () => draw(mode.value) },
    h("option", { value: "mask" }, "colour: loss mask"), h("option", { value: "logprob" }, "colour: rollout log-prob"),
    hasAdv ? h("option", { value: "advantage" }, "colour: advantage") : null);
  out.appendChild(h("h3", {}, "Tokens ", h("span", { class: "muted" },
    `${(rec.response_ids || []).length} response tokens, ` +
    (rec.in_loss === false ? `${nTrained} generated, none trained (${rec.outcome}: left out of the loss)`
      : `${nTrained} trained`) +
    (rec.response_tokens ? "" : " · no tokenizer found: showing ids")), " ", mode));
  draw("mask");
  out.appendChild(tokBox);
  return out;
}

window.h = h;
window.renderTrajectory = renderTrajectory;
window.outcomeBadge = outcomeBadge;
window.fmt = fmt;
window.toolCallEl = toolCallEl;
window.reasoningEl = reasoningEl;
