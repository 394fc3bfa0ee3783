// The chat page of `ssd serve` (docs/serving.md, "The page"). It speaks the server's own
// OpenAI route, POST /v1/chat/completions, streamed, and asks for the extension field
// `ssd_speculation` of each chunk: the chunk's text cut by the tokens' sources and the engine
// step's round (K, drafts, accepted). Everything the model writes goes into the page as text
// nodes (textContent), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const SOURCES = new Set(["draft", "head", "lookup", "suffix"]);

const state = {
  messages: [],      // the conversation: {role, content}
  abort: null,       // the AbortController of the answer streaming now
  last: {},          // the last finished answer's tok/s by "sd" / "ar"
  serverMode: "ar",
};

// ---- the API key: asked for in the page, kept in this tab (sessionStorage) only -----------
$("key").value = sessionStorage.getItem("ssd-api-key") || "";
$("key").addEventListener("change", () => {
  sessionStorage.setItem("ssd-api-key", $("key").value);
  connect();
});

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

async function errorOf(response) {
  // The server's errors are OpenAI's shape: {"error": {"message": ...}}.
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

// ---- the model's name and the server's mode ----------------------------------------------
async function connect() {
  try {
    const health = await (await fetch("health")).json();
    state.serverMode = health.mode || "ar";
    $("mode").textContent = state.serverMode;
    const speculating = state.serverMode !== "ar";
    $("speculate").disabled = !speculating;
    $("speculate").checked = speculating;
    const models = await fetch("v1/models", { headers: headers() });
    if (!models.ok) {
      $("model").textContent = "";
      showError(await errorOf(models) + (models.status === 401 ? " (enter the server's API key in Settings)" : ""));
      return;
    }
    $("model").textContent = (await models.json()).data[0].id;
    showError("");
  } catch (e) {
    showError("cannot reach the server: " + e.message);
  }
}

// ---- the conversation --------------------------------------------------------------------
function addMessage(role, text) {
  const box = document.createElement("div");
  box.className = "message " + role;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role === "user" ? "You" : "Model";
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text || "";
  const stats = document.createElement("div");
  stats.className = "stats";
  box.append(who, body, stats);
  $("conversation").append(box);
  box.scrollIntoView({ block: "end" });
  return { box, body, stats };
}

function appendPieces(body, pieces) {
  // Each piece becomes a text node, in a span coloured by the source of its tokens where they
  // were accepted drafts (a target's own token: plain text).
  for (const piece of pieces) {
    if (!piece.text) continue;
    if (SOURCES.has(piece.source)) {
      const span = document.createElement("span");
      span.className = "src-" + piece.source;
      span.title = "accepted from the " + ({ draft: "draft model", head: "head", lookup: "prompt lookup",
                                             suffix: "suffix index" })[piece.source];
      span.textContent = piece.text;
      body.append(span);
    } else {
      body.append(document.createTextNode(piece.text));
    }
  }
}

// ---- the strip: live figures and the rounds' plot -------------------------------------------
function newTally(speculate) {
  return { speculate, tokens: 0, rounds: 0, drafted: 0, accepted: 0, firstAt: null, lastAt: null, ks: [] };
}

function record(tally, step) {
  tally.tokens += step.tokens;
  tally.rounds += 1;
  tally.drafted += step.drafted;
  tally.accepted += step.accepted;
  if (tally.firstAt === null) {
    tally.firstAt = step.at_s;       // decode speed counts from the first token, as ssd_metrics does
    tally.firstTokens = step.tokens;
  }
  tally.lastAt = step.at_s;
  tally.ks.push([step.k, step.accepted]);
}

function tokensPerSecond(tally) {
  const span = tally.lastAt - tally.firstAt;
  return span > 0 ? (tally.tokens - tally.firstTokens) / span : null;
}

function drawStrip(tally) {
  const tps = tokensPerSecond(tally);
  $("tps").textContent = tps === null ? "–" : tps.toFixed(1);
  $("acceptance").textContent = tally.drafted ? Math.round(100 * tally.accepted / tally.drafted) + "%" : "–";
  $("per-pass").textContent = tally.rounds ? (tally.tokens / tally.rounds).toFixed(2) : "–";
  const k = tally.ks.length ? tally.ks[tally.ks.length - 1][0] : null;
  $("k-now").textContent = k === null ? "–" : (tally.speculate ? String(k) : "0 (plain)");
  const canvas = $("rounds");
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const kMax = Math.max(4, ...tally.ks.map(([k]) => k));
  const shown = tally.ks.slice(-160);
  const w = canvas.width / Math.max(shown.length, 40);
  const h = (canvas.height - 6) / kMax;
  shown.forEach(([k, accepted], i) => {
    const x = i * w;
    g.fillStyle = "#6cc46c";
    g.fillRect(x + 0.5, canvas.height - accepted * h, Math.max(w - 1, 1), accepted * h);
    g.strokeStyle = "#888";
    g.strokeRect(x + 0.5, canvas.height - k * h, Math.max(w - 1, 1), k * h);
  });
}

function showCompare() {
  const sd = state.last.sd, ar = state.last.ar;
  const parts = [];
  if (sd) parts.push(`speculating ${sd.toFixed(1)} tok/s`);
  if (ar) parts.push(`plain ${ar.toFixed(1)} tok/s`);
  const ratio = sd && ar ? ` (${(sd / ar).toFixed(2)}x)` : "";
  $("compare").textContent = parts.length ? "Last answers: " + parts.join(", ") + ratio : "";
}

// ---- asking ----------------------------------------------------------------------------------
function parseSSE(buffer, onEvent) {
  // Server-sent events: "data: {...}" blocks separated by a blank line; returns what is left.
  let cut;
  while ((cut = buffer.indexOf("\n\n")) >= 0) {
    const block = buffer.slice(0, cut);
    buffer = buffer.slice(cut + 2);
    for (const line of block.split("\n")) {
      if (line.startsWith("data: ")) onEvent(line.slice(6));
    }
  }
  return buffer;
}

async function ask(text) {
  showError("");
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const answer = addMessage("assistant", "");
  const speculate = $("speculate").checked && !$("speculate").disabled;
  const tally = newTally(speculate);
  drawStrip(tally);
  const system = $("system").value.trim();
  const body = {
    messages: (system ? [{ role: "system", content: system }] : []).concat(state.messages),
    stream: true,
    stream_options: { include_usage: true, include_speculation: true },
    temperature: Number($("temperature").value) || 0,
    max_tokens: Math.max(1, parseInt($("max-tokens").value, 10) || 512),
  };
  if (!speculate && state.serverMode !== "ar") body.speculate = false;
  state.abort = new AbortController();
  setBusy(true);
  let content = "", finished = null, metrics = null;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.abort.signal,
    });
    if (!response.ok) throw new Error(await errorOf(response));
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer = parseSSE(buffer + decoder.decode(value, { stream: true }), (data) => {
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.error) throw new Error(event.error.message || "the server failed");
        const choice = (event.choices || [])[0];
        const spec = event.ssd_speculation;
        if (choice && choice.delta && choice.delta.content) {
          content += choice.delta.content;
          appendPieces(answer.body, spec ? spec.pieces : [{ text: choice.delta.content, source: null }]);
          answer.box.scrollIntoView({ block: "end" });
        }
        if (spec && spec.step) {
          record(tally, spec.step);
          drawStrip(tally);
        }
        if (choice && choice.finish_reason) finished = choice.finish_reason;
        if (event.ssd_metrics) metrics = event.ssd_metrics;
      });
    }
  } catch (e) {
    if (e.name === "AbortError") {
      finished = "stopped";
    } else {
      showError(e.message);
    }
  } finally {
    state.abort = null;
    setBusy(false);
  }
  if (content) state.messages.push({ role: "assistant", content });
  else state.messages.pop();  // nothing came back: the question can be asked again
  const tps = metrics ? metrics.decode_tokens_per_second : tokensPerSecond(tally);
  const figures = [];
  if (finished) figures.push(finished);
  if (tps) figures.push(`${tps.toFixed(1)} tok/s`);
  if (tally.drafted) figures.push(`acceptance ${Math.round(100 * tally.accepted / tally.drafted)}%`);
  if (tally.rounds) figures.push(`${(tally.tokens / tally.rounds).toFixed(2)} tokens a target pass`);
  answer.stats.textContent = figures.join(" · ");
  if (tps && finished !== "stopped") {
    state.last[speculate ? "sd" : "ar"] = tps;
    showCompare();
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  $("reset").disabled = busy;
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("message").value.trim();
  if (!text || state.abort) return;
  $("message").value = "";
  ask(text);
});
$("message").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("ask").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("reset").addEventListener("click", () => {
  state.messages = [];
  $("conversation").replaceChildren();
  showError("");
});

connect();
