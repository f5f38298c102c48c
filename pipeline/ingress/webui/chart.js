// A line chart on a canvas: a few series over a shared time axis, drawn whole each time (a
// few hundred points), scaled to the device's pixels and the canvas's CSS width.

const COLORS = ["#1f77b4", "#d6553a", "#2a9d4b"];

function styleOf(canvas, name, fallback) {
  return getComputedStyle(canvas).getPropertyValue(name).trim() || fallback;
}

function fit(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = Math.max(200, canvas.clientWidth || canvas.width);
  const height = Number(canvas.getAttribute("height"));
  if (canvas.width !== Math.round(width * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return { ctx, width, height };
}

function niceMax(value) {
  if (value <= 0) return 1;
  const step = 10 ** Math.floor(Math.log10(value));
  return [1, 2, 5, 10].map((m) => m * step).find((m) => m >= value);
}

// points: [{t, values: [..]}] with t in seconds; spanS: the window shown, ending at `now`.
export function drawChart(canvas, points, { now, spanS = 300, unit = "" } = {}) {
  const { ctx, width, height } = fit(canvas);
  const ink = styleOf(canvas, "--ink", "#222"), grid = styleOf(canvas, "--grid", "#ddd");
  const left = 48, bottom = 18, top = 6, right = 8;
  const plotW = width - left - right, plotH = height - top - bottom;
  const max = niceMax(Math.max(0, ...points.flatMap((p) => p.values)));
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px sans-serif";
  ctx.fillStyle = ink;
  ctx.strokeStyle = grid;
  for (let i = 0; i <= 4; i += 1) {
    const y = top + plotH - (plotH * i) / 4;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + plotW, y); ctx.stroke();
    const label = ((max * i) / 4).toFixed(max >= 8 ? 0 : 1);
    ctx.fillText(label + unit, 2, y + 4);
  }
  ctx.fillText(`-${Math.round(spanS / 60)} min`, left, height - 4);
  ctx.fillText("now", left + plotW - 22, height - 4);
  const x = (t) => left + plotW - ((now - t) / spanS) * plotW;
  const y = (v) => top + plotH - (v / max) * plotH;
  const series = points.length ? points[0].values.length : 0;
  for (let s = 0; s < series; s += 1) {
    ctx.strokeStyle = COLORS[s % COLORS.length];
    ctx.lineWidth = 2;
    ctx.beginPath();
    points.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p.values[s])) : ctx.moveTo(x(p.t), y(p.values[s]))));
    ctx.stroke();
  }
}
