// The pagellm demo page: streams chat completions over SSE and shows live engine stats.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null, model: null };

function addMessage(role, text) {
  $("empty-hint")?.remove();
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.textContent = text;
  $("messages").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

const KEY_STORE = "pagellm-api-key";

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function fmt(x, digits = 1) { return Number.isFinite(x) ? x.toFixed(digits) : "–"; }

async function send(event) {
  event?.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || state.controller) return;
  $("prompt").value = "";
  state.messages.push({ role: "user", content: prompt });
  addMessage("user", prompt);
  const bubble = addMessage("assistant streaming", "");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const started = performance.now();
  let firstAt = null, tokens = 0, text = "";
  const body = {
    model: state.model, messages: state.messages, stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(body), signal: controller.signal,
    });
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      if (res.status === 401) $("key-panel").hidden = false;
      throw new Error(err?.error?.message || `HTTP ${res.status}`);
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.usage) { tokens = chunk.usage.completion_tokens; }
        const piece = chunk.choices?.[0]?.delta?.content;
        if (piece) {
          if (firstAt === null) { firstAt = performance.now(); $("stat-ttft").textContent = `${fmt(firstAt - started, 0)} ms`; }
          text += piece;
          tokens += chunk.usage ? 0 : 1;
          bubble.textContent = text;
          bubble.scrollIntoView({ block: "end" });
          const secs = (performance.now() - firstAt) / 1000;
          $("stat-tps").textContent = secs > 0 ? fmt(tokens / secs) : "–";
          $("stat-tokens").textContent = String(tokens);
        }
      }
    }
  } catch (err) {
    if (err.name === "AbortError") {
      text += text ? " …" : "…";
      bubble.textContent = text;
      const meta = document.createElement("span"); meta.className = "meta"; meta.textContent = "stopped";
      bubble.appendChild(meta);
    } else {
      bubble.classList.add("error");
      bubble.textContent = `Error: ${err.message}`;
    }
  } finally {
    bubble.classList.remove("streaming");
    if (text) state.messages.push({ role: "assistant", content: text });
    $("stat-tokens").textContent = String(tokens);
    state.controller = null;
    setBusy(false);
    $("prompt").focus();
  }
}

async function refreshStats() {
  try {
    const s = await (await fetch("/stats")).json();
    state.model = s.model;
    if (s.api_key_required) $("key-panel").hidden = false;
    $("model-name").textContent = `${s.model} · context ${s.max_model_len}`;
    $("stat-running").textContent = s.running;
    $("stat-waiting").textContent = s.waiting;
    $("stat-kv").textContent = `${fmt(100 * s.kv_cache_usage)} %`;
    $("kv-bar").style.width = `${100 * s.kv_cache_usage}%`;
    $("stat-server-tps").textContent = fmt(s.tokens_per_second);
    $("stat-prefix").textContent = `${fmt(100 * s.prefix_cache_hit_rate)} %`;
    $("health-dot").className = "dot up";
  } catch {
    $("health-dot").className = "dot down";
  }
}

$("api-key").value = localStorage.getItem(KEY_STORE) || "";
$("api-key").addEventListener("input", () => localStorage.setItem(KEY_STORE, $("api-key").value.trim()));
$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) send(e);
});
$("stop").addEventListener("click", () => state.controller?.abort());
$("clear").addEventListener("click", () => {
  state.controller?.abort();
  state.messages = [];
  $("messages").innerHTML = '<div class="empty" id="empty-hint">New chat. Ask something.</div>';
});
for (const [input, out] of [["temperature", "temperature-value"], ["top-p", "top-p-value"]]) {
  $(input).addEventListener("input", () => { $(out).textContent = $(input).value; });
}
refreshStats();
setInterval(refreshStats, 1000);
