// minigpt serve's page: stream a completion, then show what each head attended to, beside the run's curves.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg"; // the SVG namespace's name, not a request
// the text drawn as tokens, its attention rows by position (promises), the token whose row is shown, whether
// a click keeps it there, and the running completion's AbortController
const state = { text: "", rows: new Map(), selected: null, pinned: false, abort: null };
// the conversation of chat mode, as /v1/chat/completions takes it (the system message apart)
// and how many of its oldest messages no longer fit in the model's context
const chat = { messages: [], first: 0 };
const models = new Map(); // id -> the model's entry of /v1/models
let apiKey = localStorage.getItem("minigpt-api-key") || "";

function say(message) {
  $("status").textContent = message;
}

// Every call to the API: JSON in and out, the key when there is one, OpenAI's error message on failure.
async function api(path, body, signal) {
  const headers = { "Content-Type": "application/json" };
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  const init = { headers, signal };
  if (body !== undefined) Object.assign(init, { method: "POST", body: JSON.stringify(body) });
  const response = await fetch(path, init);
  if (response.status === 401) {
    $("keybox").hidden = false;
    throw new Error("this server wants an API key: type it above");
  }
  if (!response.ok) {
    const error = await response.json().catch(() => ({}));
    throw new Error(error.error ? error.error.message : response.statusText);
  }
  return response;
}

const model = () => $("model").value;

async function loadModels() {
  const { data } = await (await api("/v1/models")).json();
  data.forEach((m) => models.set(m.id, m));
  $("model").replaceChildren(...data.map((m) => new Option(m.id, m.id)));
  say("");
  pickMode();
  await loadRun();
}

// --- writing: the completion streams in over server-sent events ---------------------------------------

function sampling() {
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const stop = $("stop").value.replace(/\\n/g, "\n").replace(/\\t/g, "\t");
  return {
    model: model(), stream: true, max_tokens: number("max_tokens"), temperature: number("temperature"),
    top_p: number("top_p"), top_k: number("top_k"), seed: number("seed"), stop: stop ? [stop] : undefined,
  };
}

function request() {
  return { ...sampling(), prompt: $("prompt").value };
}

// Yields the JSON of each `data:` line of an SSE body until `data: [DONE]`.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).replace(/^data: /, "");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function generate(event) {
  event.preventDefault();
  if (state.abort) return state.abort.abort();
  const body = request();
  const output = $("output");
  const written = element("span", "");
  const prompt = element("span", body.prompt, "prompt");
  output.replaceChildren(prompt, written);
  output.dataset.chunks = "0";
  clearAttention();
  state.abort = new AbortController();
  $("go").textContent = "Stop";
  say("");
  try {
    const response = await api("/v1/completions", body, state.abort.signal);
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      written.textContent += chunk.choices.map((c) => c.text).join("");
      output.dataset.chunks = String(Number(output.dataset.chunks) + 1);
    }
  } catch (error) {
    if (error.name !== "AbortError") say(error.message);
  } finally {
    state.abort = null;
    $("go").textContent = "Generate";
  }
  await showTokens(body.prompt, written.textContent);
}

// --- chat: the conversation as bubbles, each answer streamed in -----------------------------------------

const chatMode = () => $("mode").value === "chat";

// Chat for runs fine-tuned on conversations, completion for the others (either can be picked by hand).
function pickMode() {
  const entry = models.get(model());
  $("mode").value = entry && entry.chat ? "chat" : "complete";
  showMode();
}

function showMode() {
  const chatting = chatMode();
  $("chatbar").hidden = $("log").hidden = !chatting;
  $("output").hidden = $("hint").hidden = $("attention").hidden = chatting;
  $("prompt").placeholder = chatting
    ? "A message (Enter sends, Shift+Enter for a new line)"
    : "A prompt to continue (empty: start from scratch)";
  $("go").textContent = chatting ? "Send" : "Generate";
}

function resetChat() {
  if (state.abort) state.abort.abort();
  chat.messages = [];
  chat.first = 0;
  $("log").replaceChildren();
}

// The answer's response; a conversation too long for the model's context loses its oldest turns until it
// fits (as `minigpt chat` does), and the page says so.
async function chatResponse(signal) {
  const system = $("system").value.trim();
  for (;;) {
    const recent = chat.messages.slice(chat.first);
    const messages = (system ? [{ role: "system", content: system }] : []).concat(recent);
    try {
      return await api("/v1/chat/completions", { ...sampling(), messages }, signal);
    } catch (error) {
      if (!/^the conversation is \d+ tokens/.test(error.message) || recent.length < 2) throw error;
      chat.first += 2; // a question and its answer
      say(`the oldest ${chat.first} messages no longer fit in the model's context and are left out`);
    }
  }
}

async function send(event) {
  event.preventDefault();
  if (state.abort) return state.abort.abort();
  const text = $("prompt").value;
  if (!text.trim()) return;
  $("prompt").value = "";
  chat.messages.push({ role: "user", content: text });
  const answer = element("div", "", "msg assistant");
  $("log").append(element("div", text, "msg user"), answer);
  state.abort = new AbortController();
  $("go").textContent = "Stop";
  say("");
  try {
    const response = await chatResponse(state.abort.signal);
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      answer.textContent += chunk.choices.map((c) => c.delta.content || "").join("");
    }
  } catch (error) {
    if (error.name === "AbortError") answer.classList.add("stopped");
    else say(error.message);
  } finally {
    state.abort = null;
    $("go").textContent = "Send";
  }
  if (answer.textContent) chat.messages.push({ role: "assistant", content: answer.textContent });
  else chat.messages.pop(); // nothing was answered: the question is not part of the conversation
}

// --- attention: the text as tokens, and each head's weights from the chosen one -----------------------

function clearAttention() {
  state.rows.clear();
  state.selected = null;
  state.pinned = false;
  $("heads").replaceChildren();
  $("att-title").textContent = "";
}

async function attention(position) {
  if (!state.rows.has(position)) {
    const body = { model: model(), text: state.text, position };
    const pending = api("/v1/attention", body).then((response) => response.json());
    pending.catch(() => state.rows.delete(position)); // a failed request is asked again next time
    state.rows.set(position, pending);
  }
  return state.rows.get(position);
}

// Re-draws the output as one span per token (what the model reads: the text's last block_size tokens).
async function showTokens(prompt, completion) {
  state.text = prompt + completion;
  if (!state.text) return;
  let data;
  try {
    data = await attention(-1);
  } catch (error) {
    return say(error.message);
  }
  state.rows.set(data.position, Promise.resolve(data));
  const layers = [...Array(data.n_layer).keys()].map((l) => new Option(`${l}`, l));
  $("layer").replaceChildren(...layers);
  $("layer").value = data.n_layer - 1;
  const shown = data.tokens.join("");
  let offset = state.text.length - shown.length; // characters of dropped tokens come first
  const spans = data.tokens.map((token, i) => {
    const span = element("span", token, "tok");
    if (offset < prompt.length) span.classList.add("prompt");
    offset += token.length;
    span.dataset.pos = i;
    span.addEventListener("mouseenter", () => state.pinned || select(i));
    span.addEventListener("click", () => select(i, true));
    return span;
  });
  const outside = element("span", state.text.slice(0, state.text.length - shown.length), "outside");
  outside.title = `${data.dropped} tokens before the model's window of ${data.tokens.length}`;
  $("output").replaceChildren(outside, ...spans);
  select(data.tokens.length - 1);
}

async function select(position, pin = false) {
  state.pinned = pin || state.pinned;
  if (pin && state.selected === position) state.pinned = false; // a second click lets hovering go on
  state.selected = position;
  for (const span of document.querySelectorAll("#output .tok")) {
    span.classList.toggle("selected", Number(span.dataset.pos) === position);
  }
  try {
    drawHeads(await attention(position));
  } catch (error) {
    say(error.message);
  }
}

function drawHeads(data) {
  if (data.position !== state.selected) return; // a later hover has already asked for another token
  const layer = Number($("layer").value);
  $("att-title").textContent =
    `from token ${data.position} (${JSON.stringify(data.tokens[data.position])}), layer ${layer}: ` +
    "darker = more weight";
  const rows = data.weights[layer].map((weights, h) => {
    const text = element("div", "", "text");
    text.append(...weights.map((w, p) => {
      const span = element("span", data.tokens[p], p === data.position ? "query" : "");
      span.title = `${(100 * w).toFixed(1)}%`;
      span.style.background = `rgba(194, 65, 12, ${Math.sqrt(w).toFixed(3)})`; // sqrt: small weights show
      return span;
    }));
    const row = element("div", "", "head");
    row.append(element("b", `h${h}`), text);
    return row;
  });
  $("heads").replaceChildren(...rows);
}

// --- the run: summary, loss curves, parameter table ---------------------------------------------------

async function loadRun() {
  const run = await (await api(`/v1/runs/${encodeURIComponent(model())}`)).json();
  $("run-name").textContent = run.summary.path;
  const s = run.summary;
  const facts = {
    data: s.data, tokenizer: s.tokenizer, shape: s.shape, parameters: s.params.toLocaleString(),
    steps: s.steps ?? "–", "best val loss": s.best_val_loss?.toFixed(4) ?? "–",
    "bits per byte": s.best_val_bpb?.toFixed(3) ?? "–", recipe: s.settings || "–",
    "exported to": s.exports.join(", ") || "–",
  };
  const pairs = Object.entries(facts).map(([k, v]) => [element("dt", k), element("dd", String(v))]);
  $("summary").replaceChildren(...pairs.flat());
  drawCurve(run.metrics);
  drawParams(run.params);
}

function element(tag, text, className) {
  return Object.assign(document.createElement(tag), { textContent: text, className: className || "" });
}

function svg(tag, attributes, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attributes)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawCurve(metrics) {
  const points = (kind, key) =>
    metrics.filter((r) => r.kind === kind && Number.isFinite(r[key])).map((r) => [r.step, r[key]]);
  const train = points("train", "loss");
  const val = points("eval", "val_loss");
  const all = train.concat(val);
  const box = $("curve");
  if (!all.length) return box.replaceChildren(svg("text", { x: 10, y: 20 }, "no metrics.jsonl in this run"));
  const [w, h, left, bottom] = [360, 200, 36, 20];
  const maxStep = Math.max(...all.map((p) => p[0])) || 1;
  const lo = Math.min(...all.map((p) => p[1]));
  const hi = Math.max(...all.map((p) => p[1]));
  const x = (step) => left + ((w - left - 8) * step) / maxStep;
  const y = (loss) => 8 + ((h - bottom - 8) * (hi - loss)) / (hi - lo || 1);
  // a line through one point draws nothing: a series of one (a run evaluated once) is a dot
  const line = (pairs, cls) =>
    pairs.length === 1
      ? svg("circle", { class: cls, cx: x(pairs[0][0]), cy: y(pairs[0][1]), r: 3 })
      : svg("polyline", { class: cls, points: pairs.map(([s, l]) => `${x(s)},${y(l)}`).join(" ") });
  box.replaceChildren(
    svg("line", { class: "axis", x1: left, y1: h - bottom, x2: w, y2: h - bottom }),
    svg("line", { class: "axis", x1: left, y1: 0, x2: left, y2: h - bottom }),
    svg("text", { x: 2, y: 12 }, hi.toFixed(2)),
    svg("text", { x: 2, y: h - bottom }, lo.toFixed(2)),
    svg("text", { x: w - 4, y: h - 6, "text-anchor": "end" }, `step ${maxStep}`),
    line(train, "train"),
    line(val, "val"),
    svg("text", { x: w - 4, y: 14, "text-anchor": "end", class: "train-label" }, "train"),
    svg("text", { x: w - 4, y: 28, "text-anchor": "end", class: "val-label" }, "validation"),
  );
}

function drawParams(report) {
  const row = (cells, cls) => {
    const tr = element("tr", "", cls);
    tr.append(element("td", cells[0]), element("td", cells[1], "formula"), element("td", cells[2]));
    return tr;
  };
  const rows = report.breakdown.map((r) => row([r.name, r.formula, r.count.toLocaleString()]));
  rows.push(row(["Total (GPT-3 style)", "", report.gpt3_total.toLocaleString()], "total"));
  rows.push(...report.adjustments.map((r) => row([r.name, r.formula, r.count.toLocaleString()])));
  rows.push(row(["Exact total", "", report.exact_total.toLocaleString()], "total"));
  $("params").replaceChildren(...rows);
}

// --- wiring -------------------------------------------------------------------------------------------

$("form").addEventListener("submit", (event) => (chatMode() ? send(event) : generate(event)));
$("prompt").addEventListener("keydown", (event) => {
  if (chatMode() && event.key === "Enter" && !event.shiftKey) send(event);
});
$("mode").addEventListener("change", showMode);
$("reset").addEventListener("click", resetChat);
$("model").addEventListener("change", () => {
  clearAttention();
  resetChat();
  pickMode();
  loadRun().catch((e) => say(e.message));
});
$("layer").addEventListener("change", () => state.selected !== null && select(state.selected));
$("key").addEventListener("change", () => {
  apiKey = $("key").value;
  localStorage.setItem("minigpt-api-key", apiKey);
  loadModels().catch((e) => say(e.message));
});
loadModels().catch((e) => say(e.message));
