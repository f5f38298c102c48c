// The chat view: model picker, settings, a conversation kept in this browser (localStorage),
// streamed answers rendered as Markdown, reasoning folded, tool calls shown, a stop button.

import { getJSON, streamEvents } from "./api.js";
import { escapeHtml, renderMarkdown } from "./markdown.js";

const STORE = "pagedserve.chat";
const $ = (id) => document.getElementById(id);

function load() {
  try {
    return JSON.parse(localStorage.getItem(STORE)) || {};
  } catch (_) {
    return {};
  }
}

function numberOrNull(value) {
  return value === "" || value === undefined ? null : Number(value);
}

// The request body from the settings form's values and the conversation so far.
export function requestBody(settings, messages) {
  const body = { model: settings.model, stream: true, stream_options: { include_usage: true } };
  body.messages = settings.system ? [{ role: "system", content: settings.system }] : [];
  for (const m of messages) {
    const turn = { role: m.role, content: m.content };
    if (m.tool_calls && m.tool_calls.length) turn.tool_calls = m.tool_calls;
    body.messages.push(turn);
  }
  for (const name of ["temperature", "top_p", "top_k", "max_tokens", "min_tokens", "seed"]) {
    const value = numberOrNull(settings[name]);
    if (value !== null) body[name] = value;
  }
  if (settings.json_mode) {
    body.response_format = { type: "json_schema",
      json_schema: { name: "answer", schema: JSON.parse(settings.json_schema || "{}") } };
  }
  if (settings.tools && settings.tools.trim()) body.tools = JSON.parse(settings.tools);
  return body;
}

// One streamed chunk into the assistant message being built.
export function applyChunk(message, chunk) {
  if (chunk.error) throw new Error(chunk.error.message || "the server failed mid-answer");
  if (chunk.usage) message.usage = chunk.usage;
  const choice = chunk.choices && chunk.choices[0];
  if (!choice) return;
  const delta = choice.delta || {};
  if (delta.content) message.content += delta.content;
  if (delta.reasoning_content) message.reasoning = (message.reasoning || "") + delta.reasoning_content;
  for (const call of delta.tool_calls || []) {
    message.tool_calls = message.tool_calls || [];
    const slot = message.tool_calls[call.index] ||= { id: "", type: "function",
      function: { name: "", arguments: "" } };
    if (call.id) slot.id = call.id;
    if (call.function && call.function.name) slot.function.name += call.function.name;
    if (call.function && call.function.arguments) slot.function.arguments += call.function.arguments;
  }
  if (choice.finish_reason) message.finish_reason = choice.finish_reason;
}

function statsLine(m) {
  if (!m.usage && !m.timing) return "";
  const parts = [];
  if (m.usage) parts.push(`prompt ${m.usage.prompt_tokens} tokens`, `answer ${m.usage.completion_tokens} tokens`);
  const t = m.timing || {};
  if (m.usage && t.first && t.end > t.first) {
    parts.push(`${(m.usage.completion_tokens / ((t.end - t.first) / 1000)).toFixed(1)} tokens/s`);
  }
  if (t.first) parts.push(`first token after ${((t.first - t.start) / 1000).toFixed(2)} s`);
  if (m.finish_reason) parts.push(`finished: ${m.finish_reason}`);
  return parts.join(" · ");
}

function renderInto(li, m) {
  let html = `<div class="who">${m.role === "user" ? "You" : escapeHtml(m.model || "assistant")}</div>`;
  if (m.reasoning) {
    html += `<details class="reasoning"><summary>Reasoning</summary><div>${renderMarkdown(m.reasoning)}</div></details>`;
  }
  html += `<div class="content">${m.role === "user" ? `<p>${escapeHtml(m.content).replace(/\n/g, "<br>")}</p>` : renderMarkdown(m.content)}</div>`;
  for (const call of m.tool_calls || []) {
    html += `<div class="tool-call"><div>Tool call <code>${escapeHtml(call.function.name)}</code></div><pre><code>${escapeHtml(call.function.arguments)}</code></pre></div>`;
  }
  if (m.error) html += `<p class="error" role="alert">${escapeHtml(m.error)}</p>`;
  const stats = statsLine(m);
  if (stats) html += `<div class="stats">${escapeHtml(stats)}</div>`;
  const open = li.querySelector("details.reasoning[open]") !== null;
  li.innerHTML = html;
  if (open) li.querySelector("details.reasoning").open = true;
  li.className = m.role + (m.stopped ? " stopped" : "");
}

export class ChatView {
  constructor(say) {
    this.say = say;  // status line
    const saved = load();
    this.messages = saved.messages || [];
    this.settings = saved.settings || {};
    this.controller = null;
    this.list = $("messages");
    this.bind();
    this.restoreSettings();
    this.messages.forEach((m) => this.append(m));
  }

  bind() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); this.send(); });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); this.send(); }
    });
    document.addEventListener("keydown", (e) => { if (e.key === "Escape") this.stop(); });
    $("stop").addEventListener("click", () => this.stop());
    $("clear").addEventListener("click", () => { this.messages = []; this.list.innerHTML = ""; this.save(); });
    $("settings").addEventListener("change", () => { this.settings = this.readSettings(); this.save(); });
  }

  readSettings() {
    const form = $("settings");
    const values = Object.fromEntries(new FormData(form).entries());
    values.json_mode = $("json-mode").checked;
    return values;
  }

  restoreSettings() {
    for (const [name, value] of Object.entries(this.settings)) {
      const field = $("settings").elements[name];
      if (!field || name === "model") continue;
      if (field.type === "checkbox") field.checked = Boolean(value);
      else field.value = value;
    }
  }

  save() {
    localStorage.setItem(STORE, JSON.stringify({ messages: this.messages, settings: this.settings }));
  }

  async loadModels() {
    const select = $("model");
    const { data } = await getJSON("/v1/models");
    const previous = this.settings.model || select.value;
    select.innerHTML = "";
    for (const model of data) {
      const option = document.createElement("option");
      option.value = model.id;
      const notes = [model.parent ? `adapter of ${model.parent}` : "",
        model.state && model.state !== "loaded" ? model.state : ""].filter(Boolean);
      option.textContent = notes.length ? `${model.id} (${notes.join(", ")})` : model.id;
      select.append(option);
    }
    if (data.some((m) => m.id === previous)) select.value = previous;
    this.settings = this.readSettings();
  }

  append(message) {
    const li = document.createElement("li");
    renderInto(li, message);
    this.list.append(li);
    li.scrollIntoView({ block: "end" });
    return li;
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  async send() {
    const text = $("prompt").value.trim();
    if (!text || this.controller) return;
    this.settings = this.readSettings();
    let body;
    try {
      body = requestBody(this.settings, [...this.messages, { role: "user", content: text }]);
    } catch (err) {
      this.say(`Settings: ${err.message}`);
      return;
    }
    $("prompt").value = "";
    const user = { role: "user", content: text };
    this.messages.push(user);
    this.append(user);
    await this.stream(body);
  }

  async stream(body) {
    const answer = { role: "assistant", model: body.model, content: "", timing: { start: Date.now() } };
    this.messages.push(answer);
    const li = this.append(answer);
    this.controller = new AbortController();
    this.busy(true);
    let frame = 0;  // one render per animation frame, however many chunks arrive in it
    const render = () => { frame = 0; renderInto(li, answer); li.scrollIntoView({ block: "end" }); };
    try {
      for await (const chunk of streamEvents("/v1/chat/completions", body, this.controller.signal)) {
        applyChunk(answer, chunk);
        if (!answer.timing.first && (answer.content || answer.reasoning || answer.tool_calls)) answer.timing.first = Date.now();
        if (!frame) frame = requestAnimationFrame(render);
      }
    } catch (err) {
      if (err.name === "AbortError") { answer.stopped = true; answer.finish_reason = "stopped"; }
      else answer.error = err.message;
    } finally {
      answer.timing.end = Date.now();
      if (frame) cancelAnimationFrame(frame);
      this.controller = null;
      this.busy(false);
      render();
      $("chat-stats").textContent = statsLine(answer);
      this.save();
    }
  }

  busy(on) {
    $("send").disabled = on;
    $("stop").disabled = !on;
    this.list.setAttribute("aria-busy", String(on));
  }
}
