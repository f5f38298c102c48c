// The engine view: polls /engine/state once a second (the same endpoint on an engine and on
// the router, which lists every replica) and shows the gauges, rates over the last minutes
// (kept in the page), the processes and the router's replicas.

import { getJSON } from "./api.js";
import { drawChart } from "./chart.js";

const SPAN_S = 300;
const $ = (id) => document.getElementById(id);

// The engines' stats summed (a router's replicas are added up).
export function totals(engines) {
  const sum = { running: 0, waiting: 0, swapped: 0, kvUsed: 0, kvTotal: 0, prefixQueries: 0,
    prefixHits: 0, promptTokens: 0, generationTokens: 0, steps: 0, stepTokens: 0, aborted: 0 };
  for (const { stats = {} } of engines) {
    sum.running += stats.num_requests_running || 0;
    sum.waiting += stats.num_requests_waiting || 0;
    sum.swapped += stats.num_requests_swapped || 0;
    sum.kvUsed += stats.kv_blocks_used || 0;
    sum.kvTotal += stats.kv_blocks_total || 0;
    sum.prefixQueries += stats.prefix_cache_queries || 0;
    sum.prefixHits += stats.prefix_cache_hits || 0;
    sum.promptTokens += stats.prompt_tokens || 0;
    sum.generationTokens += stats.generation_tokens || 0;
    sum.steps += (stats.iteration_tokens || {}).count || 0;
    sum.stepTokens += (stats.iteration_tokens || {}).sum || 0;
    sum.aborted += stats.requests_aborted || 0;
  }
  return sum;
}

// Per-second rates between two samples; a counter that went back (a restarted scheduler)
// counts from zero.
export function rates(prev, cur) {
  const dt = Math.max(1e-3, cur.t - prev.t);
  const grow = (k) => Math.max(0, cur.sum[k] - (cur.sum[k] >= prev.sum[k] ? prev.sum[k] : 0));
  const steps = grow("steps");
  return { t: cur.t, in: grow("promptTokens") / dt, out: grow("generationTokens") / dt,
    tokensPerStep: steps ? grow("stepTokens") / steps : null };
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.floor(seconds);
  if (s < 120) return `${s} s`;
  if (s < 7200) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

function fillRows(tbody, rows) {
  tbody.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      td.textContent = cell;
      tr.append(td);
    }
    return tr;
  }));
}

export class EngineView {
  constructor(say) {
    this.say = say;
    this.samples = [];  // [{t, sum}] over the last SPAN_S seconds
    this.series = [];   // [{t, in, out, tokensPerStep, running, waiting}]
    this.timer = null;
    this.lastTokensPerStep = null;
  }

  start() {
    if (this.timer) return;
    this.poll();
    this.timer = setInterval(() => this.poll(), 1000);
  }

  stop() {
    clearInterval(this.timer);
    this.timer = null;
  }

  async poll() {
    let state;
    try {
      state = await getJSON("/engine/state");
    } catch (err) {
      this.say(`Engine state: ${err.message}`);
      return;
    }
    const sample = { t: state.time, sum: totals(state.engines) };
    const prev = this.samples[this.samples.length - 1];
    this.samples.push(sample);
    if (prev) {
      const r = rates(prev, sample);
      this.series.push({ ...r, running: sample.sum.running, waiting: sample.sum.waiting });
      if (r.tokensPerStep !== null) this.lastTokensPerStep = r.tokensPerStep;
    }
    const since = state.time - SPAN_S;
    this.samples = this.samples.filter((s) => s.t >= since);
    this.series = this.series.filter((s) => s.t >= since);
    this.render(state, sample.sum);
  }

  render(state, sum) {
    const show = (name, text) => { document.querySelector(`[data-metric="${name}"]`).textContent = text; };
    show("running", sum.running);
    show("waiting", sum.waiting);
    show("swapped", sum.swapped);
    show("batch", sum.running);
    show("tokens_per_step", this.lastTokensPerStep === null ? "–" : this.lastTokensPerStep.toFixed(1));
    show("kv", sum.kvTotal ? `${((100 * sum.kvUsed) / sum.kvTotal).toFixed(1)} % (${sum.kvUsed} / ${sum.kvTotal} blocks)` : "–");
    show("prefix_hits", sum.prefixQueries ? `${((100 * sum.prefixHits) / sum.prefixQueries).toFixed(1)} %` : "–");
    show("aborted", sum.aborted);
    show("tokens", `${sum.promptTokens} / ${sum.generationTokens}`);
    const now = state.time;
    drawChart($("chart-tokens"), this.series.map((s) => ({ t: s.t, values: [s.in, s.out] })), { now, spanS: SPAN_S });
    drawChart($("chart-requests"), this.series.map((s) => ({ t: s.t, values: [s.running, s.waiting] })), { now, spanS: SPAN_S });
    this.renderTables(state);
  }

  renderTables(state) {
    const rows = [];
    for (const engine of state.engines) {
      for (const p of engine.processes || []) {
        rows.push([engine.name, p.name, String(p.pid), duration(p.uptime_s), String(p.restarts)]);
      }
      if (engine.error) rows.push([engine.name, "–", "–", "–", engine.error]);
    }
    fillRows($("processes").tBodies[0], rows);
    const replicas = state.replicas || [];
    $("replicas-block").hidden = replicas.length === 0;
    fillRows($("replicas").tBodies[0], replicas.map((r) => [r.id, r.model,
      r.healthy ? "healthy" : "down", `${r.outstanding_requests} requests, ${r.outstanding_tokens} tokens`,
      String(r.restarts)]));
  }
}
