// qkv's page: plain JavaScript, no framework, no build step. It calls the server's JSON API:
// /v1/models to list the models, /v1/translate, /v1/generate (Server-Sent Events), /v1/chat,
// /v1/embed, /v1/classify for the output, then /v1/attention for every attention map of it
// (and the beam search's trace), which it draws as token-by-token heatmaps.
"use strict";

const $ = (id) => document.getElementById(id);
const TASKS = { translate: "Translate", generate: "Continue (streamed)", chat: "Chat", embed: "Embed", classify: "Classify" };
const PARTS = {
  encoder: ["Encoder self-attention", "each source token (row) over the source (columns)"],
  decoder: ["Decoder masked self-attention", "each output step (row) over the tokens read so far"],
  cross: ["Cross-attention", "each output token (row) over the source tokens (columns)"],
};
const state = { models: [], view: null, chat: [] };

async function api(path, body) {
  const init = body === undefined ? {} : { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  const response = await fetch(path, init);
  const data = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(data.error ? data.error.message : `HTTP ${response.status}`);
  return data;
}

function element(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "text") node.textContent = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

const model = () => state.models.find((m) => m.name === $("model").value);
const task = () => $("task").value;
const number = (id) => Number($(id).value);
const status = (text, error = false) => {
  $("status").textContent = text;
  $("status").classList.toggle("error", error);
};

// ------------------------------------------------------------------------------ set-up

async function init() {
  try {
    state.models = (await api("/v1/models")).models;
  } catch (e) {
    status(`cannot list the models: ${e.message}`, true);
    return;
  }
  for (const m of state.models) $("model").append(element("option", { value: m.name, text: m.name }));
  $("model").addEventListener("change", chooseModel);
  $("task").addEventListener("change", showOptions);
  $("form").addEventListener("submit", run);
  $("clear-chat").addEventListener("click", () => { state.chat = []; $("output").replaceChildren(); });
  $("layer").addEventListener("change", draw);
  $("head").addEventListener("change", draw);
  chooseModel();
}

function chooseModel() {
  const m = model();
  if (!m) return;
  $("model-kind").textContent = `${m.kind.replace("_", "-")}, ${m.heads} heads, window ${m.window}`;
  const tasks = m.endpoints.map((e) => e.replace("/v1/", "")).filter((t) => t in TASKS);
  $("task").replaceChildren(...tasks.map((t) => element("option", { value: t, text: TASKS[t] })));
  state.chat = [];
  showOptions();
}

function showOptions() {
  for (const node of document.querySelectorAll("[data-for]")) {
    node.hidden = !node.dataset.for.split(" ").includes(task());
  }
}

// ------------------------------------------------------------------------------ running

async function run(event) {
  event.preventDefault();
  const m = model();
  const text = $("text").value;
  if (!m || !text.trim()) {
    status("type a text first", true);
    return;
  }
  $("run").disabled = true;
  status("working…");
  try {
    const ask = await ({ translate, generate, chat, embed, classify })[task()](m, text);
    status("reading the attention…");
    showAttention(await api("/v1/attention", { model: m.name, ...ask }));
    status("");
  } catch (e) {
    status(e.message, true);
  } finally {
    $("run").disabled = false;
  }
}

function sampling() {
  const options = {};
  if ($("sample").checked) {
    options.sample = true;
    options.temperature = number("temperature");
    if ($("top-k").value) options.top_k = number("top-k");
  }
  return options;
}

async function translate(m, text) {
  const beam = number("beam");
  const nbest = Math.min(number("nbest"), beam);
  const found = await api("/v1/translate", {
    model: m.name, text, beam_size: beam, nbest, length_penalty: number("length-penalty"),
  });
  const list = element("ol", { class: "nbest", "aria-label": "Translations, best first" });
  for (const h of found.translations[0]) {
    list.append(element("li", {}, element("span", { class: "text", text: h.text }), element("span", { class: "score", text: h.score.toFixed(4) })));
  }
  $("output").replaceChildren(list);
  return { text, beam_size: beam, length_penalty: number("length-penalty"), trace: $("want-trace").checked };
}

async function generate(m, text) {
  const shown = element("span", { class: "continuation" });
  $("output").replaceChildren(element("div", { class: "text", id: "generated" }, element("span", { class: "prompt", text }), shown));
  const response = await fetch("/v1/generate", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model: m.name, prompt: text, max_new_tokens: number("max-new"), stream: true, ...sampling() }),
  });
  if (!response.ok) {
    const data = await response.json().catch(() => ({}));
    throw new Error(data.error ? data.error.message : `HTTP ${response.status}`);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let made = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const { name, data } = parseEvent(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
      if (name === "token") {
        made += data.text;
        shown.textContent = made;
      } else if (name === "error") {
        throw new Error(data.error.message);
      } else if (name === "done") {
        made = data.text;
        shown.textContent = made;
        $("generated").dataset.done = "true";
        $("generated").dataset.tokens = data.tokens;
      }
    }
  }
  return { text, output: made };
}

function parseEvent(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) name = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).trim());
  }
  return { name, data: JSON.parse(data.join("\n") || "{}") };
}

async function chat(m, text) {
  const messages = [...state.chat, text];
  const found = await api("/v1/chat", {
    model: m.name, messages, max_new_tokens: number("max-new"), beam_size: number("beam"), ...sampling(),
  });
  state.chat = [...messages, found.reply];
  $("output").replaceChildren(
    ...state.chat.map((turn, i) => element("p", { class: "turn" }, element("b", { text: i % 2 ? "model" : "you" }), element("span", { text: turn })))
  );
  $("text").value = "";
  return { text, output: found.reply };
}

async function embed(m, text) {
  const found = await api("/v1/embed", { model: m.name, text });
  const vector = found.embeddings[0];
  const norm = Math.sqrt(vector.reduce((a, x) => a + x * x, 0));
  $("output").replaceChildren(
    element("p", { text: `${vector.length} numbers, length ${norm.toFixed(4)}: ${vector.slice(0, 6).map((x) => x.toFixed(3)).join(", ")}, …` }),
    element("p", { class: "note", text: found.settings })
  );
  return { text };
}

async function classify(m, text) {
  const found = await api("/v1/classify", { model: m.name, text });
  $("output").replaceChildren(element("p", { class: "text", text: found.labels[0] }));
  return { text };
}

// ------------------------------------------------------------------------------ attention

function showAttention(view) {
  state.view = view;
  $("attention").hidden = false;
  const previous = $("layer").value;
  $("layer").replaceChildren(...range(view.layers).map((i) => element("option", { value: i, text: `${i + 1} of ${view.layers}` })));
  $("layer").value = previous !== "" && Number(previous) < view.layers ? previous : String(view.layers - 1);
  const head = $("head").value;
  $("head").replaceChildren(
    ...range(view.heads).map((i) => element("option", { value: i, text: `${i + 1}` })),
    element("option", { value: "all", text: "All heads" })
  );
  $("head").value = head && (head === "all" || Number(head) < view.heads) ? head : "0";
  $("attention-note").textContent =
    view.kind === "encoder_decoder"
      ? `Source: ${view.source_tokens.length} tokens; output: ${view.predicted_tokens.length} tokens (END included). Hover a token to see where it looks, or what looks at it.`
      : `${(view.source_tokens.length || view.target_tokens.length)} tokens. Hover a token to see where it looks.`;
  draw();
  showTrace(view.trace);
}

const range = (n) => Array.from({ length: n }, (_, i) => i);

function parts(view) {
  const found = [];
  if (view.encoder) found.push({ key: "encoder", maps: view.encoder, rows: view.source_tokens, cols: view.source_tokens });
  if (view.decoder) found.push({ key: "decoder", maps: view.decoder, rows: view.predicted_tokens, cols: view.target_tokens });
  if (view.cross) found.push({ key: "cross", maps: view.cross, rows: view.predicted_tokens, cols: view.source_tokens });
  return found;
}

function meanOfHeads(heads) {
  const rows = heads[0].length;
  const cols = heads[0][0].length;
  return range(rows).map((r) => range(cols).map((c) => heads.reduce((a, h) => a + h[r][c], 0) / heads.length));
}

// The weights of one part at the chosen layer: one head's (rows x cols), or all heads' mean.
function chosen(part) {
  const layer = Number($("layer").value);
  const heads = part.maps[layer];
  if (!heads) return null;
  const head = $("head").value;
  return head === "all" ? meanOfHeads(heads) : heads[Number(head)];
}

function draw() {
  const view = state.view;
  if (!view) return;
  const layer = Number($("layer").value);
  const head = $("head").value;
  const panels = [];
  for (const part of parts(view)) {
    const [title, sub] = PARTS[part.key];
    const caption = element("figcaption", {}, `${title}`, element("span", { class: "sub", text: `layer ${layer + 1}, ${head === "all" ? "all heads" : `head ${Number(head) + 1}`}: ${sub}` }));
    const figure = element("figure", { class: head === "all" ? "panel all" : "panel", dataset: { part: part.key } }, caption);
    const heads = part.maps[layer];
    if (!heads) {
      figure.append(element("p", { class: "note", text: `no layer ${layer + 1} here (${part.maps.length} layers)` }));
    } else if (head === "all") {
      const grid = element("div", { class: "heads" });
      heads.forEach((matrix, h) => {
        grid.append(element("div", {}, element("div", { class: "head-title", text: `head ${h + 1}` }), heatmap(part, matrix, true, `${title}, head ${h + 1}`)));
      });
      figure.append(element("div", { class: "scroll" }, grid));
    } else {
      figure.append(element("div", { class: "scroll" }, heatmap(part, heads[Number(head)], false, title)));
    }
    panels.push(figure);
  }
  $("panels").replaceChildren(...panels);
  drawTokens(view);
}

function heatmap(part, matrix, small, title) {
  const table = element("table", {
    class: `heatmap${small ? " small" : ""}`,
    dataset: { part: part.key, rows: matrix.length, cols: matrix[0] ? matrix[0].length : 0 },
  });
  table.append(element("caption", { class: "visually-hidden", text: `${title}: rows attend to columns` }));
  const head = element("tr", {}, element("td", { "aria-hidden": "true" }));
  part.cols.forEach((token, c) => head.append(element("th", { scope: "col", text: small ? "" : token, dataset: { c }, onmouseenter: () => hoverColumn(part.key, c), onmouseleave: unhover })));
  table.append(element("thead", {}, head));
  const body = element("tbody");
  matrix.forEach((row, r) => {
    const tr = element("tr", { dataset: { r } }, element("th", { scope: "row", text: small ? "" : part.rows[r], dataset: { r }, onmouseenter: () => hoverRow(part.key, r), onmouseleave: unhover }));
    row.forEach((w, c) => {
      tr.append(element("td", { style: `background: rgba(var(--hot), ${w.toFixed(3)})`, title: `${part.rows[r]} → ${part.cols[c]}: ${w.toFixed(3)}`, dataset: { w: w.toFixed(4) } }));
    });
    body.append(tr);
  });
  table.append(body);
  return table;
}

// The token strips: the source (what the encoder read) and the output (what the decoder wrote).
function drawTokens(view) {
  const lines = [];
  const chip = (side, token, i) =>
    element("span", {
      class: "tok", tabindex: "0", text: token, dataset: { side, i },
      onmouseenter: () => hoverToken(side, i), onmouseleave: unhover, onfocus: () => hoverToken(side, i), onblur: unhover,
    });
  const line = (label, side, tokens) =>
    element("div", { class: "line", dataset: { side } }, element("span", { class: "what", text: label }), ...tokens.map((t, i) => chip(side, t, i)));
  if (view.kind === "encoder_decoder") {
    lines.push(line("source", "source", view.source_tokens), line("output", "output", view.predicted_tokens));
  } else if (view.kind === "decoder_only") {
    lines.push(line("tokens", "output", view.target_tokens));
  } else {
    lines.push(line("tokens", "source", view.source_tokens));
  }
  $("tokens").replaceChildren(...lines);
}

function part(key) {
  return parts(state.view).find((p) => p.key === key);
}

// Hovering an output token: the source tokens it attends to (cross-attention; a decoder-only
// model's own earlier tokens); hovering a source token: the output tokens that attend to it
// (an encoder-only model: the tokens it attends to).
function hoverToken(side, i) {
  const kind = state.view.kind;
  if (kind === "encoder_decoder") (side === "output" ? hoverRow : hoverColumn)("cross", i);
  else if (kind === "decoder_only") hoverRow("decoder", i);
  else hoverRow("encoder", i);
}

function hoverRow(key, r) {
  const p = part(key);
  const weights = p && chosen(p);
  if (!weights) return;
  unhover();
  const rowSide = key === "encoder" ? "source" : "output";
  const colSide = key === "cross" || key === "encoder" ? "source" : "output";
  mark(colSide, weights[r], rowSide === colSide ? null : [rowSide, r]);
  if (rowSide === colSide) focusChip(rowSide, r);
  for (const th of document.querySelectorAll(`table.heatmap[data-part="${key}"] tbody th[data-r="${r}"]`)) th.classList.add("focus");
}

function hoverColumn(key, c) {
  const p = part(key);
  const weights = p && chosen(p);
  if (!weights) return;
  unhover();
  const colSide = key === "cross" || key === "encoder" ? "source" : "output";
  const rowSide = key === "encoder" ? "source" : "output";
  mark(rowSide, weights.map((row) => row[c]), [colSide, c]);
  for (const th of document.querySelectorAll(`table.heatmap[data-part="${key}"] thead th[data-c="${c}"]`)) th.classList.add("focus");
}

// Shade the chips of one side by ``weights`` (scaled to the largest); outline the hovered chip.
function mark(side, weights, hovered) {
  const top = Math.max(...weights, 1e-9);
  document.querySelectorAll(`.tok[data-side="${side}"]`).forEach((chip) => {
    const w = weights[Number(chip.dataset.i)] ?? 0;
    chip.style.background = `rgba(var(--mark), ${(0.6 * w / top).toFixed(3)})`;
    chip.dataset.weight = w.toFixed(4);
    chip.classList.toggle("lit", w / top > 0.25);
  });
  if (hovered) focusChip(...hovered);
}

function focusChip(side, i) {
  const chip = document.querySelector(`.tok[data-side="${side}"][data-i="${i}"]`);
  if (chip) chip.classList.add("focus");
}

function unhover() {
  document.querySelectorAll(".tok").forEach((chip) => {
    chip.style.background = "";
    chip.classList.remove("focus", "lit");
    delete chip.dataset.weight;
  });
  document.querySelectorAll("table.heatmap th.focus").forEach((th) => th.classList.remove("focus"));
}

// ------------------------------------------------------------------------------ the beam trace

function showTrace(trace) {
  $("trace").hidden = !trace;
  if (!trace) return;
  $("trace-beam").textContent = trace.beam_size;
  const hyp = (h) => element("span", { class: "hyp" }, h.tokens.join(" ") || "(empty)", element("span", { class: "score", text: h.score.toFixed(3) }));
  const rows = trace.steps.map((step) =>
    element(
      "tr",
      { dataset: { step: step.step } },
      element("th", { scope: "row", text: `${step.step + 1}${step.capped ? " (cap)" : ""}` }),
      element("td", { class: "live" }, ...step.live.map(hyp)),
      element("td", { class: "ended" }, ...step.ended.map(hyp)),
      element("td", { class: "dropped" }, ...step.dropped.map(hyp))
    )
  );
  $("trace-table").tBodies[0].replaceChildren(...rows);
}

init();
