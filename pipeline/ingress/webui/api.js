// Calls to the server: every one carries the API key the user typed (kept in this browser's
// localStorage), and streamed answers are read as server-sent events.

const KEY_STORE = "pagedserve.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || message;
  } catch (_) { /* not JSON: the status says it */ }
  if (response.status === 401) message = `${message} (type the server's API key above)`;
  return new ApiError(response.status, message);
}

export async function api(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) throw await errorOf(response);
  return response;
}

export async function getJSON(path, signal) {
  return (await api(path, { signal })).json();
}

// Each `data:` event of a streamed answer as parsed JSON, until [DONE]. Aborting `signal`
// closes the connection, which the server takes as the client leaving: it aborts the request.
export async function* streamEvents(path, body, signal) {
  const response = await api(path, { method: "POST", body, signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end = buffer.indexOf("\n\n");
    while (end >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      end = buffer.indexOf("\n\n");
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}
