// Hand-rolled SVG line charts for the learning curves: no library, no build step.
// lineChart(el, {title, series: [{name, points: [[x, y], ...]}], xrange, onZoom})
//   drag across the plot to zoom the x axis (onZoom([x0, x1])), double-click to reset (onZoom(null)).
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
const MAX_MARKERS = 2000; // beyond this only the polyline is drawn (points stay countable via data-points)

function svgEl(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
  if (parent) parent.appendChild(el);
  return el;
}

function niceTicks(lo, hi, n) {
  if (!(hi > lo)) { hi = lo + 1; lo = lo - 1; }
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

function fmtNum(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e4 || a < 1e-3) return v.toExponential(1);
  return +v.toPrecision(4) + "";
}

function lineChart(el, opts) {
  el.innerHTML = "";
  const W = 420, H = 220, L = 52, R = 10, T = 24, B = 28;
  const series = opts.series.filter((s) => s.points.length);
  let pts = series.flatMap((s) => s.points);
  const [xlo, xhi] = opts.xrange || [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
  const visible = pts.filter((p) => p[0] >= xlo && p[0] <= xhi);
  let ylo = Math.min(...visible.map((p) => p[1])), yhi = Math.max(...visible.map((p) => p[1]));
  if (!isFinite(ylo)) { ylo = 0; yhi = 1; }
  if (ylo === yhi) { ylo -= Math.abs(ylo) * 0.1 || 0.5; yhi += Math.abs(yhi) * 0.1 || 0.5; }
  const pad = (yhi - ylo) * 0.05; ylo -= pad; yhi += pad;
  const xs = (x) => L + ((x - xlo) / ((xhi - xlo) || 1)) * (W - L - R);
  const ys = (y) => H - B - ((y - ylo) / (yhi - ylo)) * (H - T - B);

  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", "data-title": opts.title }, el);
  svgEl("text", { x: L, y: 15, class: "chart-title" }, svg).textContent = opts.title;
  const clipId = "clip" + Math.random().toString(36).slice(2);
  svgEl("rect", { x: L, y: T, width: W - L - R, height: H - T - B }, svgEl("clipPath", { id: clipId }, svg));
  for (const t of niceTicks(ylo, yhi, 4)) {
    svgEl("line", { x1: L, x2: W - R, y1: ys(t), y2: ys(t), class: "grid" }, svg);
    svgEl("text", { x: L - 4, y: ys(t) + 3, class: "tick", "text-anchor": "end" }, svg).textContent = fmtNum(t);
  }
  for (const t of niceTicks(xlo, xhi, 5)) {
    svgEl("text", { x: xs(t), y: H - B + 14, class: "tick", "text-anchor": "middle" }, svg).textContent = fmtNum(t);
  }
  svgEl("text", { x: W - R, y: H - 2, class: "tick", "text-anchor": "end" }, svg).textContent = "step";
  const plot = svgEl("g", { "clip-path": `url(#${clipId})` }, svg);
  const markers = pts.length <= MAX_MARKERS;
  series.forEach((s, i) => {
    const color = PALETTE[i % PALETTE.length];
    const g = svgEl("g", { class: "series", "data-name": s.name, "data-points": s.points.length }, plot);
    svgEl("polyline", { points: s.points.map((p) => `${xs(p[0])},${ys(p[1])}`).join(" "), stroke: color,
      fill: "none", "stroke-width": 1.5 }, g);
    if (markers) for (const p of s.points) {
      const c = svgEl("circle", { cx: xs(p[0]), cy: ys(p[1]), r: 2.5, fill: color, class: "pt" }, g);
      svgEl("title", {}, c).textContent = `${s.name}\nstep ${p[0]}: ${p[1]}`;
    }
    svgEl("text", { x: L + 6 + 0, y: T + 12 + 12 * i, class: "legend", fill: color }, svg).textContent = s.name;
  });
  if (opts.onZoom) addBrush(svg, { L, R, T, B, W, H, xlo, xhi }, opts.onZoom);
  return svg;
}

function addBrush(svg, g, onZoom) {
  const area = svgEl("rect", { x: g.L, y: g.T, width: g.W - g.L - g.R, height: g.H - g.T - g.B, class: "brush-area" }, svg);
  let start = null, box = null;
  const toX = (evt) => {
    const r = svg.getBoundingClientRect();
    return ((evt.clientX - r.left) / r.width) * g.W;
  };
  const toData = (px) => g.xlo + ((px - g.L) / (g.W - g.L - g.R)) * (g.xhi - g.xlo);
  area.addEventListener("mousedown", (e) => {
    start = toX(e);
    box = svgEl("rect", { x: start, y: g.T, width: 0, height: g.H - g.T - g.B, class: "brush" }, svg);
  });
  svg.addEventListener("mousemove", (e) => {
    if (start === null) return;
    const x = Math.max(g.L, Math.min(g.W - g.R, toX(e)));
    box.setAttribute("x", Math.min(start, x)); box.setAttribute("width", Math.abs(x - start));
  });
  svg.addEventListener("mouseup", (e) => {
    if (start === null) return;
    const x = toX(e), a = toData(Math.min(start, x)), b = toData(Math.max(start, x));
    start = null; box.remove();
    if (Math.abs(b - a) > 1e-9 && (b - a) / (g.xhi - g.xlo) > 0.01) onZoom([a, b]);
  });
  svg.addEventListener("dblclick", () => onZoom(null));
}

window.lineChart = lineChart;
