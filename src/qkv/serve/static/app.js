// qkv's page: plain JavaScript, no framework, no build step. It calls the server's JSON API:
// /v1/models to list the models (and an example input for each), /v1/translate, /v1/generate
// (Server-Sent Events), /v1/chat, /v1/embed, /v1/classify for the output, then /v1/attention for
// every attention map of it (and the beam search's trace). It draws the chosen map large, with
// token labels, a colour scale and the value under the pointer, and every layer and head of the
// chosen kind (encoder, decoder, cross) as a grid of small maps beside it. The speech, speech-out
// and chat views are views.js's.
"use strict";

const $ = (id) => document.getElementById(id);
const TASKS = { translate: "Translate", generate: "Continue (streamed)", chat: "Chat", embed: "Embed", classify: "Classify" };
const SHORT = { encoder: ["Encoder", " self-attention"], decoder: ["Decoder", " masked self-attention"], cross: ["Cross", "-attention"] };
const PARTS = {
  encoder: ["Encoder self-attention", "each source token (row) over the source (columns)"],
  decoder: ["Decoder masked self-attention", "each output step (row) over the tokens read so far"],
  cross: ["Cross-attention", "each output token (row) over the source tokens (columns)"],
};
const state = { models: [], view: null, chat: [], part: null };
const range = (n) => Array.from({ length: n }, (_, i) => i);

// A number with ``digits`` decimals that is never "-0.0000": what rounds to zero shows as 0.
function fmt(x, digits = 4) {
  const shown = x.toFixed(digits);
  return Number(shown) === 0 ? (0).toFixed(digits) : shown;
}

// fetch, but a response that is not ok throws the server's own message (its JSON error body).
async function fetched(path, init) {
  const response = await fetch(path, init);
  if (!response.ok) {
    const data = await response.json().catch(() => ({}));
    throw new Error(data.error ? data.error.message : `HTTP ${response.status}`);
  }
  return response;
}

const jsonPost = (body) => ({ method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });

async function api(path, body) {
  const response = await fetched(path, body === undefined ? {} : jsonPost(body));
  return response.json().catch(() => ({}));
}

// The server-sent events of a streamed response, one { name, data } per event as the HTML
// standard frames them ("event:" and "data:" lines, an empty line ends an event); data is the
// event's text, its "data:" lines joined by new lines.
async function* serverEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      yield parseEvent(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
    }
  }
}

function parseEvent(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) name = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).trim());
  }
  return { name, data: data.join("\n") };
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
  setUpViews();
  $("task").addEventListener("change", showOptions);
  $("form").addEventListener("submit", run);
  $("clear-chat").addEventListener("click", () => { state.chat = []; $("output").replaceChildren(); });
  $("layer").addEventListener("change", draw);
  $("head").addEventListener("change", draw);
  $("scale").addEventListener("change", draw);
  let resizing = 0;
  window.addEventListener("resize", () => {
    clearTimeout(resizing);
    resizing = setTimeout(() => { if (state.view) draw(); redrawTime(); }, 150);
  });
  chooseModel();
}

function chooseModel() {
  const m = model();
  if (!m) return;
  const layers = Object.entries(m.layers).map(([side, n]) => `${n} ${side} layer${n === 1 ? "" : "s"}`).join(" + ");
  const task = m.task ? `${m.task}, ` : "";
  const reads = m.window ? `, window ${m.window}` : "";
  $("model-kind").textContent = `${task}${m.kind.replaceAll("_", "-")}: ${layers}, ${m.heads} heads${reads}`;
  $("text").placeholder = m.example;
  chooseViews(m);
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
  if ($("text").value.trim() === "" && task() !== "chat") $("text").value = $("text").placeholder; // the model's example
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
    list.append(element("li", {}, element("span", { class: "text", text: h.text }), element("span", { class: "score", text: fmt(h.score) })));
  }
  $("output").replaceChildren(list);
  return { text, beam_size: beam, length_penalty: number("length-penalty"), trace: $("want-trace").checked };
}

async function generate(m, text) {
  const shown = element("span", { class: "continuation" });
  $("output").replaceChildren(element("div", { class: "text", id: "generated" }, element("span", { class: "prompt", text }), shown));
  const response = await fetched("/v1/generate", jsonPost({
    model: m.name, prompt: text, max_new_tokens: number("max-new"), stream: true, ...sampling(),
  }));
  let made = "";
  for await (const { name, data } of serverEvents(response)) {
    const event = JSON.parse(data || "{}");
    if (name === "token") {
      made += event.text;
      shown.textContent = made;
    } else if (name === "error") {
      throw new Error(event.error.message);
    } else if (name === "done") {
      made = event.text;
      shown.textContent = made;
      $("generated").dataset.done = "true";
      $("generated").dataset.tokens = event.tokens;
    }
  }
  return { text, output: made };
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
    element("p", { text: `${vector.length} numbers, length ${fmt(norm)}: ${vector.slice(0, 6).map((x) => fmt(x, 3)).join(", ")}, …` }),
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

// ColorBrewer's sequential "Blues": light is little weight, dark is much; it stays in order in
// greyscale and for colour-blind readers. SHADES: 256 steps of it, as [r, g, b].
const BLUES = [[247, 251, 255], [222, 235, 247], [198, 219, 239], [158, 202, 225], [107, 174, 214],
  [66, 146, 198], [33, 113, 181], [8, 81, 156], [8, 48, 107]];
const SHADES = range(256).map((i) => {
  const x = (i / 255) * (BLUES.length - 1);
  const k = Math.min(Math.floor(x), BLUES.length - 2);
  return BLUES[k].map((a, j) => Math.round(a + (BLUES[k + 1][j] - a) * (x - k)));
});
const MASKED = [226, 229, 233]; // a position the decoder may not read (a later one)
const rgb = (c) => `rgb(${c.join(", ")})`;
const masked = (key, r, c) => key === "decoder" && c > r; // row r reads positions 0..r
const shadeOf = (w, top) => SHADES[Math.round(255 * Math.min(Math.max(w / top, 0), 1))];

function showAttention(view) {
  state.view = view;
  $("attention").hidden = false;
  const found = parts(view);
  if (!found.some((p) => p.key === state.part)) state.part = found[found.length - 1].key; // cross first
  $("attention-title").textContent = `Attention: ${view.model}`;
  $("parts").replaceChildren(
    ...found.map((p) => element("button", {
      type: "button", role: "tab", id: `tab-${p.key}`, "aria-controls": "map-figure", dataset: { part: p.key },
      "aria-label": PARTS[p.key][0], onclick: () => choosePart(p.key),
    }, SHORT[p.key][0], element("span", { class: "long", text: SHORT[p.key][1] })))
  );
  const head = $("head").value;
  $("head").replaceChildren(
    ...range(view.heads).map((i) => element("option", { value: i, text: `${i + 1}` })),
    element("option", { value: "all", text: "Mean of heads" })
  );
  $("head").value = head && (head === "all" || Number(head) < view.heads) ? head : "0";
  $("attention-note").textContent =
    view.kind === "encoder_decoder"
      ? `Source: ${view.source_tokens.length} tokens; output: ${view.predicted_tokens.length} tokens (END included). Hover a token to see where it looks, or what looks at it.`
      : `${(view.source_tokens.length || view.target_tokens.length)} tokens. Hover a token to see where it looks.`;
  choosePart(state.part);
  showTrace(view.trace);
}

// Show one kind of attention: its layers in the layer menu (kept where it has that layer).
function choosePart(key) {
  state.part = key;
  const n = part(key).maps.length;
  const previous = $("layer").value;
  $("layer").replaceChildren(...range(n).map((i) => element("option", { value: i, text: `${i + 1} of ${n}` })));
  $("layer").value = previous !== "" && Number(previous) < n ? previous : String(n - 1);
  draw();
}

function parts(view) {
  const found = [];
  if (view.encoder) found.push({ key: "encoder", maps: view.encoder, rows: view.source_tokens, cols: view.source_tokens });
  if (view.decoder) found.push({ key: "decoder", maps: view.decoder, rows: view.predicted_tokens, cols: view.target_tokens, reads: view.target_tokens });
  if (view.cross) found.push({ key: "cross", maps: view.cross, rows: view.predicted_tokens, cols: view.source_tokens, reads: view.target_tokens });
  return found;
}

function part(key) {
  return parts(state.view).find((p) => p.key === key);
}

function meanOfHeads(heads) {
  const rows = heads[0].length;
  const cols = heads[0][0].length;
  return range(rows).map((r) => range(cols).map((c) => heads.reduce((a, h) => a + h[r][c], 0) / heads.length));
}

// The weights of one map: a head's (rows x cols) at a layer, or the mean of the layer's heads.
const mapOf = (p, layer, head) => (head === "all" ? meanOfHeads(p.maps[layer]) : p.maps[layer][Number(head)]);
const headName = (head) => (head === "all" ? "mean of heads" : `head ${Number(head) + 1}`);

// The weights chosen in the menus for one part (null where that part lacks the layer).
function chosen(p) {
  const layer = Number($("layer").value);
  return p.maps[layer] ? mapOf(p, layer, $("head").value) : null;
}

// The weight the darkest shade stands for: 1, or the map's largest weight.
function topOf(matrix) {
  if ($("scale").value !== "top") return 1;
  return Math.max(1e-9, ...matrix.map((row) => Math.max(...row)));
}

function draw() {
  const view = state.view;
  if (!view) return;
  const p = part(state.part);
  for (const tab of $("parts").children) tab.setAttribute("aria-selected", String(tab.dataset.part === p.key));
  const layer = Number($("layer").value);
  const head = $("head").value;
  const weights = mapOf(p, layer, head);
  const top = topOf(weights);
  const [title, sub] = PARTS[p.key];
  $("map-figure").dataset.part = p.key;
  $("map-caption").replaceChildren(
    `${title}: layer ${layer + 1} of ${p.maps.length}, ${headName(head)}`,
    element("span", { class: "sub", text: sub })
  );
  drawLegend(top, p.key === "decoder");
  $("map-wrap").replaceChildren(bigMap(p, weights, top, layer, head));
  $("grid-title").textContent = `${title}: every layer and head`;
  // The grid beside the map where 18rem or more is left there, else below it, the section's width.
  const whole = $("attention").clientWidth || 600;
  const beside = whole - $("map-figure").offsetWidth - 24;
  $("grid-wrap").replaceChildren(grid(p, layer, head, beside >= 288 ? beside : whole));
  drawTokens(view);
  hideTip();
}

// The colour scale: the shades from 0 to ``top``, five ticks, and a mark for the hovered value.
function drawLegend(top, hasMasked) {
  const tick = (x) => (top === 1 ? String(x) : String(Number(x.toPrecision(2))));
  $("legend").replaceChildren(
    element("span", { class: "legend-title", text: "weight" }),
    element("div", { class: "legend-scale" },
      element("div", { class: "legend-bar", style: `background: linear-gradient(to right, ${BLUES.map(rgb).join(", ")})` },
        element("span", { class: "legend-mark", id: "legend-mark", hidden: "" })),
      element("div", { class: "legend-ticks" }, ...[0, 0.25, 0.5, 0.75, 1].map((f) => element("span", { text: tick(f * top) })))),
    ...(hasMasked ? [element("span", { class: "legend-masked" }, element("i", { style: `background: ${rgb(MASKED)}` }), "masked: a later position")] : [])
  );
}

// The chosen map as a table: a row per query token, a column per key token, a cell per weight,
// cells as large as the width allows (16 to 40 px; a wider map scrolls inside its frame).
function bigMap(p, matrix, top, layer, head) {
  const cols = matrix[0].length;
  const longest = Math.max(...p.rows.map((t) => [...t].length));
  const labels = Math.min(150, 8 * longest + 20);
  const width = ($("attention").clientWidth || 600) - 24; // the section's width less the frame's padding
  const cell = Math.max(16, Math.min(40, Math.floor((width - labels - 8) / cols)));
  const short = p.cols.every((t) => [...t].length <= 3) && cell >= 24; // column labels read across
  const table = element("table", {
    class: short ? "heatmap short" : "heatmap", style: `--cell: ${cell}px`, dataset: { part: p.key, layer, head, rows: matrix.length, cols },
  });
  table.append(element("caption", { class: "visually-hidden", text: `${PARTS[p.key][0]}: rows (queries) attend to columns (keys)` }));
  const header = element("tr", {}, element("td", { "aria-hidden": "true" }));
  p.cols.forEach((token, c) => header.append(element("th", {
    scope: "col", text: token, title: token, dataset: { c }, onmouseenter: () => hoverColumn(p.key, c), onmouseleave: unhover,
  })));
  table.append(element("thead", {}, header));
  const body = element("tbody");
  matrix.forEach((row, r) => {
    const tr = element("tr", { dataset: { r } }, element("th", {
      scope: "row", text: p.rows[r], dataset: { r }, onmouseenter: () => hoverRow(p.key, r), onmouseleave: unhover,
    }));
    row.forEach((w, c) => {
      const hidden = masked(p.key, r, c);
      tr.append(element("td", {
        class: hidden ? "masked" : "", style: `background: ${rgb(hidden ? MASKED : shadeOf(w, top))}`, dataset: { r, c, w: fmt(w) },
      }));
    });
    body.append(tr);
  });
  table.append(body);
  const at = (event) => event.target.closest && event.target.closest("td[data-c]");
  table.addEventListener("pointerover", (event) => {
    const td = at(event);
    if (td) showTip(event, p, layer, head, Number(td.dataset.r), Number(td.dataset.c), matrix, top);
  });
  table.addEventListener("pointerleave", hideTip);
  return table;
}

// Every layer (rows) and head (columns, then their mean) of one part as small maps: canvases of
// a pixel per weight, scaled up without smoothing. Each is a button: a click shows it large.
function grid(p, layer, head, width) {
  const heads = state.view.heads;
  const columns = heads + 1;
  const size = Math.max(48, Math.min(120, Math.floor((width - 72) / columns) - 14)); // less gap, padding, border
  const node = element("div", { class: "grid", style: `grid-template-columns: max-content repeat(${columns}, max-content)`, dataset: { part: p.key } });
  node.append(element("span", { class: "corner" }));
  for (const h of [...range(heads).map(String), "all"]) node.append(element("span", { class: "col-label", text: h === "all" ? "mean" : `head ${Number(h) + 1}` }));
  p.maps.forEach((_, l) => {
    node.append(element("span", { class: "row-label", text: `layer ${l + 1}` }));
    for (const h of [...range(heads).map(String), "all"]) {
      node.append(thumbnail(p, l, h, size, l === layer && h === head));
    }
  });
  return node;
}

function thumbnail(p, layer, head, size, current) {
  const matrix = mapOf(p, layer, head);
  const rows = matrix.length;
  const cols = matrix[0].length;
  const top = topOf(matrix);
  const canvas = element("canvas", { width: cols, height: rows, "aria-hidden": "true" });
  const scale = size / Math.max(rows, cols);
  canvas.style.width = `${Math.max(1, Math.round(cols * scale))}px`;
  canvas.style.height = `${Math.max(1, Math.round(rows * scale))}px`;
  const context = canvas.getContext("2d");
  const image = context.createImageData(cols, rows);
  matrix.forEach((row, r) => row.forEach((w, c) => {
    image.data.set([...(masked(p.key, r, c) ? MASKED : shadeOf(w, top)), 255], 4 * (r * cols + c));
  }));
  context.putImageData(image, 0, 0);
  const cell = (event) => {
    const box = canvas.getBoundingClientRect();
    const r = Math.min(rows - 1, Math.max(0, Math.floor(((event.clientY - box.top) / box.height) * rows)));
    const c = Math.min(cols - 1, Math.max(0, Math.floor(((event.clientX - box.left) / box.width) * cols)));
    showTip(event, p, layer, head, r, c, matrix, top);
  };
  canvas.addEventListener("pointermove", cell);
  canvas.addEventListener("pointerleave", hideTip);
  return element("button", {
    type: "button", class: "thumb", "aria-pressed": String(current), dataset: { layer, head },
    "aria-label": `${PARTS[p.key][0]}, layer ${layer + 1}, ${headName(head)}`,
    onclick: () => { $("layer").value = String(layer); $("head").value = head; draw(); $("map-figure").scrollIntoView({ block: "nearest" }); },
  }, canvas);
}

// The tooltip: the query token (the row), the key token (the column) and the weight between them.
function showTip(event, p, layer, head, r, c, matrix, top) {
  const hidden = masked(p.key, r, c);
  const w = matrix[r][c];
  const tip = $("tip");
  const reads = p.reads ? [element("span", { class: "what", text: ` (position ${r + 1}, reads ` }), element("span", { class: "token", text: p.reads[r] }), element("span", { class: "what", text: ")" })] : [];
  tip.replaceChildren(
    element("div", {}, element("span", { class: "what", text: "query " }), element("span", { class: "token q", text: p.rows[r] }), ...reads),
    element("div", {}, element("span", { class: "what", text: "key " }), element("span", { class: "token k", text: p.cols[c] })),
    element("div", { class: "value" }, element("span", { class: "v", text: hidden ? "masked" : fmt(w) }),
      element("span", { class: "what", text: hidden ? " (the decoder may not read a later position)" : ` = ${w > 0 && w < 0.0005 ? "under 0.1" : fmt(100 * w, 1)}% of the query's attention` })),
    element("div", { class: "what", text: `${PARTS[p.key][0]}, layer ${layer + 1}, ${headName(head)}` })
  );
  Object.assign(tip.dataset, { part: p.key, layer, head, r, c, w: hidden ? "" : fmt(w) });
  tip.hidden = false;
  // In page coordinates (it scrolls with the map), kept inside the viewport's width and height.
  const pad = 8;
  const room = document.documentElement.clientWidth;
  let left = event.clientX + 14;
  let y = event.clientY + 14;
  if (left + tip.offsetWidth > room - pad) left = Math.max(pad, event.clientX - 14 - tip.offsetWidth);
  if (y + tip.offsetHeight > window.innerHeight - pad) y = Math.max(pad, event.clientY - 14 - tip.offsetHeight);
  tip.style.left = `${left + window.scrollX}px`;
  tip.style.top = `${y + window.scrollY}px`;
  const mark = $("legend-mark");
  if (mark && head === $("head").value && layer === Number($("layer").value)) {
    mark.hidden = hidden;
    mark.style.left = `${100 * Math.min(w / top, 1)}%`;
  }
}

function hideTip() {
  $("tip").hidden = true;
  if ($("legend-mark")) $("legend-mark").hidden = true;
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
    chip.dataset.weight = fmt(w);
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
  const hyp = (h) => element("span", { class: "hyp" }, h.tokens.join(" ") || "(empty)", element("span", { class: "score", text: fmt(h.score, 3) }));
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
