// qkv's page, its views of speech and chat: plain JavaScript, no framework, no build step; loaded
// before app.js, whose helpers ($, element, api, fetched, jsonPost, serverEvents, fmt, range, SHADES, state) it uses once the page
// runs. Which views a model has follows from its kind: a speech model "Speech in" (upload, or
// speak into the microphone, streamed over /v1/audio/stream; the transcript's segments, a
// segment's cross-attention over its spectrogram), a TTS
// model or Piper voice "Speech out" (speak a text, its spectrogram and cross-attention), a
// language model "Text" and "Chat" (a streamed conversation; a token's attention over it).
"use strict";

const VIEWS = ["text", "chat", "speech", "tts"];
const TAGLINES = {
  text: "Type a sentence; see the output, then every attention map that made it.",
  chat: "Talk with the model; click a token of its answer to see what it attended to when it wrote it.",
  speech: "Upload or speak; see the transcript (as you speak), and what each segment's words attended to in the sound.",
  tts: "Type a sentence and hear it; see its spectrogram and which letters each stretch of sound attended to.",
};
const views = { figures: {}, speech: null, recorder: null, stopAt: null, chat: { messages: [], view: null } };

function viewsOf(m) {
  if (m.kind === "speech_encoder_decoder") return ["speech"];
  if (m.kind === "tts" || m.kind === "vits") return ["tts"];
  return m.endpoints.includes("/v1/chat/completions") ? ["text", "chat"] : ["text"];
}

function setUpViews() {
  for (const tab of document.querySelectorAll("#views button")) tab.addEventListener("click", () => showView(tab.dataset.view));
  $("speech-file").addEventListener("change", () => {
    const file = $("speech-file").files[0];
    if (file) hearing(file, file.name);
  });
  $("record").addEventListener("click", toggleRecording);
  $("speech-audio").addEventListener("timeupdate", () => {
    const audio = $("speech-audio");
    if (views.stopAt !== null && audio.currentTime >= views.stopAt) {
      audio.pause();
      views.stopAt = null;
    }
  });
  $("tts-form").addEventListener("submit", speakText);
  $("chat-form").addEventListener("submit", sendChat);
  $("new-chat").addEventListener("click", newChat);
  $("chat-sink").addEventListener("change", () => views.chat.view && drawChatTokens());
}

// A new model: its views as tabs (none shown when it has one), its example as placeholders.
function chooseViews(m) {
  const able = viewsOf(m);
  for (const tab of document.querySelectorAll("#views button")) tab.hidden = !able.includes(tab.dataset.view);
  $("views").hidden = able.length < 2;
  $("tts-text").placeholder = m.example;
  $("chat-text").placeholder = m.example;
  views.figures = {};
  for (const key of ["speech", "tts"]) $(`${key}-figure`).hidden = true;
  $("segments").replaceChildren();
  $("transcript").textContent = "";
  newChat();
  showView(able[0]);
}

function showView(name) {
  for (const tab of document.querySelectorAll("#views button")) tab.setAttribute("aria-selected", String(tab.dataset.view === name));
  for (const key of VIEWS) $(`view-${key}`).hidden = key !== name;
  $("tagline").textContent = TAGLINES[name];
  document.body.dataset.view = name;
  redrawTime();
}

const say = (id, text, error = false) => {
  $(id).textContent = text;
  $(id).classList.toggle("error", error);
};

// A token as a person reads it: byte-level BPE's Ġ (a space) and Ċ (a new line), SentencePiece's ▁.
const pretty = (token) => token.replace(/[Ġ▁]/g, " ").replace(/Ċ/g, "⏎");

async function posted(path, form) {
  const response = await fetched(path, { method: "POST", body: form });
  return response.json().catch(() => ({}));
}

// ------------------------------------------------------------------------------ speech in

// Transcribe an uploaded or recorded file (verbose_json: its segments with their times), list the
// segments, and show the first one's attention. ``streamed``: the transcript shown is the stream's
// (a recording), kept; the segments are the whole recording's, read at once.
async function hearing(blob, name, streamed = false) {
  const m = model();
  views.speech = { blob, name, segments: [], language: null };
  $("speech-audio").src = URL.createObjectURL(blob);
  $("segments").replaceChildren();
  delete $("segments").dataset.done;
  if (!streamed) {
    $("transcript").textContent = "";
    $("word-times").textContent = "";
    delete $("transcript").dataset.done;
  }
  $("speech-figure").hidden = true;
  say("speech-status", streamed ? "reading the recording's segments…" : "transcribing…");
  try {
    const form = new FormData();
    form.append("file", blob, name);
    form.append("model", m.name);
    form.append("response_format", "verbose_json");
    const heard = await posted("/v1/audio/transcriptions", form);
    views.speech.segments = heard.segments;
    views.speech.language = heard.language;
    if (!streamed) {
      $("transcript").textContent = heard.text;
      $("transcript").dataset.done = "true";
    }
    $("segments").dataset.done = "true";
    $("segments").replaceChildren(...heard.segments.map((s, i) =>
      element("li", {}, element("button", {
        type: "button", class: "segment", dataset: { i, start: s.start, end: s.end },
        onclick: () => { playStretch(s.start, s.end); showSegment(i); },
      }, element("span", { class: "when", text: `${s.start.toFixed(2)}–${s.end.toFixed(2)} s` }), element("span", { text: s.text })))
    ));
    say("speech-status", heard.segments.length ? "" : "no speech heard");
    if (heard.segments.length) await showSegment(0);
  } catch (e) {
    say("speech-status", e.message, true);
  }
}

function playStretch(start, end) {
  const audio = $("speech-audio");
  audio.currentTime = start;
  views.stopAt = end;
  audio.play().catch(() => {}); // a browser that will not play without a gesture: the stretch is still chosen
}

async function showSegment(i) {
  const s = views.speech.segments[i];
  for (const b of document.querySelectorAll("#segments .segment")) b.setAttribute("aria-current", String(b.dataset.i === String(i)));
  say("speech-status", "reading the attention…");
  const form = new FormData();
  form.append("file", views.speech.blob, views.speech.name);
  form.append("model", model().name);
  for (const [key, value] of [["start", s.start], ["end", s.end], ["tokens", s.tokens.join(",")]]) form.append(key, String(value));
  if (views.speech.language) form.append("language", views.speech.language);
  try {
    const view = await posted("/v1/audio/attention", form);
    const columns = view.cross[0][0][0].length;
    views.figures.speech = {
      view, labels: view.tokens.map(pretty), mel: view.mel, frameSeconds: view.frame_seconds, offset: view.start,
      seconds: view.end - view.start,
      cols: range(columns).map((c) => [c * view.column_seconds, (c + 1) * view.column_seconds]),
      matrix: (layer, head) => headsOf(view.cross[layer], head),
      caption: `Segment ${i + 1}, ${view.start.toFixed(2)}–${view.end.toFixed(2)} s: each token (row) over the encoder's positions in time`,
      selected: null,
    };
    pickers("speech", view.layers, view.heads);
    $("speech-figure").hidden = false;
    $("speech-figure").dataset.segment = i;
    drawTime("speech");
    say("speech-status", "");
  } catch (e) {
    say("speech-status", e.message, true);
  }
}

// The microphone, streamed: an AudioWorklet (microphone.js) turns it into 16 kHz s16le pieces of
// 0.1 s, sent over the WebSocket /v1/audio/stream as they come; the server's partial text (its
// guess, greyed) and final words (never taken back) are shown as they arrive. At Stop: the
// worklet's last piece, then {"type": "end"}; the server sends the last finals and closes. The
// pieces sent make the recording (a 16 kHz WAV), read again whole for its segments and attention.
async function toggleRecording() {
  if (views.recorder) return stopRecording();
  $("record").disabled = true;
  let media = null;
  let context = null;
  let socket = null;
  try {
    media = await navigator.mediaDevices.getUserMedia({ audio: true });
    context = new AudioContext();
    await context.resume(); // a context made after an await may start suspended
    await context.audioWorklet.addModule("/microphone.js");
    socket = await connected(model());
    const live = { media, context, socket, pieces: [], finals: [], partial: "", partials: 0 };
    live.node = new AudioWorkletNode(context, "qkv-microphone");
    live.node.port.onmessage = (e) => piece(live, e.data);
    live.socket.onmessage = (e) => heardLive(live, JSON.parse(e.data));
    live.closed = new Promise((resolve) => { live.socket.onclose = resolve; });
    live.closed.then((event) => views.recorder === live && stopRecording(event)); // the server ended it first
    context.createMediaStreamSource(media).connect(live.node);
    live.node.connect(context.destination); // silent: it outputs nothing, but a node is run only when it leads somewhere
    views.recorder = live;
    startLive();
  } catch (e) {
    if (media) for (const track of media.getTracks()) track.stop();
    if (context) context.close();
    if (socket) socket.close();
    say("speech-status", `cannot record: ${e.message}`, true);
  } finally {
    $("record").disabled = false;
  }
}

// The stream, open (the subprotocol "qkv": the server answers with it; with API keys, a proxy adds
// the header, or a page of its own offers the key too, as docs/serving.md shows).
function connected(m) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const socket = new WebSocket(`${scheme}://${location.host}/v1/audio/stream?model=${encodeURIComponent(m.name)}`, ["qkv"]);
  socket.binaryType = "arraybuffer";
  return new Promise((resolve, reject) => {
    socket.onopen = () => resolve(socket);
    socket.onerror = () => reject(new Error("the server refused the stream"));
  });
}

function startLive() {
  views.speech = null;
  $("speech-audio").removeAttribute("src");
  $("segments").replaceChildren();
  delete $("segments").dataset.done;
  $("speech-figure").hidden = true;
  $("transcript").replaceChildren();
  $("transcript").dataset.partials = "0";
  delete $("transcript").dataset.done;
  $("word-times").textContent = "";
  $("record").textContent = "Stop";
  $("record").setAttribute("aria-pressed", "true");
  say("speech-status", "listening… the words appear as you speak; press Stop when done");
}

function piece(live, data) {
  if (data.flushed) return live.flushed && live.flushed();
  live.pieces.push(data.samples);
  if (live.socket.readyState === WebSocket.OPEN) live.socket.send(data.samples);
}

function heardLive(live, message) {
  if (message.type === "partial") {
    live.partial = message.text;
    $("transcript").dataset.partials = String(++live.partials);
  } else if (message.type === "final") {
    live.finals.push(message);
  } else if (message.type === "error") {
    live.error = message.error.message;
  }
  drawLive(live);
}

// The final words, each a button that plays its stretch (once recorded), then the partial, greyed.
function drawLive(live) {
  const words = live.finals.flatMap((f) => f.words.map((w) => ({ ...w, timing: f.timing })));
  const shown = [];
  for (const w of words) {
    if (shown.length) shown.push(" ");
    shown.push(element("button", {
      type: "button", class: "word", text: w.word, dataset: { start: w.start, end: w.end, timing: w.timing },
      title: `${w.start.toFixed(2)}–${w.end.toFixed(2)} s (${w.timing})`, onclick: () => playStretch(w.start, w.end),
    }));
  }
  if (live.partial) shown.push(shown.length ? " " : "", element("span", { class: "partial", text: live.partial }));
  $("transcript").replaceChildren(...shown);
}

// Stop: the worklet's last piece and the end sent, the last finals read until the server closes
// (``ended``: the close that came first, the server's, when it ended the stream).
async function stopRecording(ended = null) {
  const live = views.recorder;
  views.recorder = null;
  $("record").disabled = true;
  if (!ended) {
    say("speech-status", "finishing…");
    const flushed = new Promise((resolve) => { live.flushed = resolve; });
    live.node.port.postMessage("flush");
    await Promise.race([flushed, new Promise((resolve) => setTimeout(resolve, 1000))]);
  }
  live.node.disconnect();
  for (const track of live.media.getTracks()) track.stop();
  live.context.close();
  if (live.socket.readyState === WebSocket.OPEN) live.socket.send(JSON.stringify({ type: "end" }));
  const closing = ended || (await live.closed);
  live.partial = "";
  drawLive(live);
  $("record").textContent = "Record";
  $("record").setAttribute("aria-pressed", "false");
  $("record").disabled = false;
  if (closing.code !== 1000) return say("speech-status", live.error || `the stream ended (${closing.code})`, true);
  $("transcript").dataset.done = "true";
  const aligned = live.finals.length && live.finals.every((f) => f.timing === "aligned");
  $("word-times").textContent = !live.finals.length ? "" : aligned
    ? "Word times: the model's own alignment (its cross-attention). Click a word to hear it."
    : "Word times: estimates (each segment's time shared out by its letters). Click a word to hear it.";
  await hearing(wavBlob(live.pieces, 16000), "recording.wav", true);
}

// A WAV of ``pieces``: ArrayBuffers of mono s16le samples at ``rate`` (the stream's own bytes).
function wavBlob(pieces, rate) {
  const n = pieces.reduce((a, p) => a + p.byteLength, 0);
  const head = new DataView(new ArrayBuffer(44));
  const text = (at, s) => [...s].forEach((ch, i) => head.setUint8(at + i, ch.charCodeAt(0)));
  text(0, "RIFF"); head.setUint32(4, 36 + n, true); text(8, "WAVE"); text(12, "fmt ");
  head.setUint32(16, 16, true); head.setUint16(20, 1, true); head.setUint16(22, 1, true); // PCM, mono
  head.setUint32(24, rate, true); head.setUint32(28, 2 * rate, true); head.setUint16(32, 2, true); head.setUint16(34, 16, true);
  text(36, "data"); head.setUint32(40, n, true);
  return new Blob([head, ...pieces], { type: "audio/wav" });
}

// ------------------------------------------------------------------------------ speech out

async function speakText(event) {
  event.preventDefault();
  const m = model();
  if (!$("tts-text").value.trim()) $("tts-text").value = $("tts-text").placeholder;
  const input = $("tts-text").value.trim();
  $("speak").disabled = true;
  say("tts-status", "speaking…");
  try {
    const response = await fetched("/v1/audio/speech", jsonPost({ model: m.name, input }));
    const blob = await response.blob();
    const audio = $("tts-audio");
    audio.src = URL.createObjectURL(blob);
    audio.dataset.bytes = blob.size;
    audio.play().catch(() => {});
    say("tts-status", "reading the attention…");
    showSpoken(await api("/v1/audio/speech/attention", { model: m.name, input }));
    say("tts-status", "");
  } catch (e) {
    say("tts-status", e.message, true);
  } finally {
    $("speak").disabled = false;
  }
}

function showSpoken(view) {
  const fs = view.frame_seconds;
  const labels = view.tokens.flat().map(pretty);
  const figure = { view, labels, mel: view.mel, frameSeconds: fs, offset: 0, seconds: view.mel.length * fs, selected: null };
  if (view.cross) {
    figure.cols = view.steps.map(([a, b]) => [a * fs, b * fs]);
    figure.matrix = (layer, head) => transpose(headsOf(view.cross[layer], head)); // (symbols, steps)
    figure.caption = "Cross-attention: each letter (row) against the decoder's steps in time, over the spectrogram it wrote";
  } else {
    // Piper puts its pad symbol "_" between phonemes: the rows show the phonemes, the pads' frames lie between them.
    const kept = range(labels.length).filter((i) => view.tokens.flat()[i] !== "_");
    figure.labels = kept.map((i) => labels[i]);
    figure.cols = kept.map((i) => view.alignment[i].map((f) => f * fs));
    figure.matrix = () => kept.map((_, r) => kept.map((_, c) => (r === c ? 1 : 0)));
    figure.caption = "A Piper voice (VITS) has no cross-attention: each phoneme (row) lasts the frames its predicted duration gave it";
  }
  views.figures.tts = figure;
  pickers("tts", view.layers, view.heads);
  $("tts-figure").hidden = false;
  drawTime("tts");
}

// ------------------------------------------------------------------------------ chat

function newChat() {
  views.chat = { messages: [], view: null };
  $("conversation").replaceChildren();
  $("chat-attention").hidden = true;
}

function drawConversation() {
  $("conversation").replaceChildren(...views.chat.messages.map((m) =>
    element("p", { class: `turn ${m.role}` }, element("b", { text: m.role === "user" ? "you" : "model" }), element("span", { text: m.content }))
  ));
}

// Send the message, stream the answer (OpenAI's chunks: data: {...}, then data: [DONE]), then read
// the attention of its last token.
async function sendChat(event) {
  event.preventDefault();
  const m = model();
  if (!$("chat-text").value.trim() && !views.chat.messages.length) $("chat-text").value = $("chat-text").placeholder;
  const text = $("chat-text").value.trim();
  if (!text) return say("chat-status", "type a message first", true);
  views.chat.messages.push({ role: "user", content: text });
  $("chat-text").value = "";
  drawConversation();
  const shown = element("span", { class: "answer", id: "answer" });
  $("conversation").append(element("p", { class: "turn assistant" }, element("b", { text: "model" }), shown));
  $("send").disabled = true;
  say("chat-status", "writing…");
  try {
    const made = await streamed(m, shown);
    views.chat.messages.push({ role: "assistant", content: made });
    shown.dataset.done = "true";
    say("chat-status", "");
    if (made) await chatAttention(null);
  } catch (e) {
    views.chat.messages.pop();
    say("chat-status", e.message, true);
  } finally {
    $("send").disabled = false;
  }
}

async function streamed(m, shown) {
  const body = {
    model: m.name, messages: views.chat.messages, stream: true,
    max_tokens: Number($("chat-max").value), temperature: Number($("chat-temperature").value),
  };
  const response = await fetched("/v1/chat/completions", jsonPost(body));
  let made = "";
  for await (const { data } of serverEvents(response)) {
    if (!data || data === "[DONE]") continue;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    for (const choice of chunk.choices || []) made += (choice.delta && choice.delta.content) || "";
    shown.textContent = made;
  }
  return made;
}

async function chatAttention(token) {
  const messages = views.chat.messages;
  const answer = messages[messages.length - 1].content;
  say("chat-status", "reading the attention…");
  const view = await api("/v1/chat/attention", { model: model().name, messages: messages.slice(0, -1), answer, token });
  views.chat.view = view;
  pickers("chat", view.layers, view.heads);
  $("chat-attention").hidden = false;
  drawChatTokens();
  say("chat-status", "");
}

function drawChatTokens() {
  const view = views.chat.view;
  const weights = headsOf(view.weights[Number($("chat-layer").value)], $("chat-head").value);
  // A language model sends most of its attention to the first token (an "attention sink", Xiao et
  // al., 2023): scaled without it, the rest of the conversation can be read.
  const scaled = $("chat-sink").checked && weights.length > 1 ? weights.slice(1) : weights;
  const top = Math.max(...scaled, 1e-9);
  const chips = view.tokens.map((token, i) => {
    const answered = i >= view.answer_start;
    const w = weights[i];
    const chip = element(answered ? "button" : "span", {
      class: `tok${answered ? " answered" : ""}${i === view.row + 1 ? " focus" : ""}`, text: pretty(token), dataset: { i },
    });
    if (w !== undefined) {
      chip.dataset.weight = fmt(w);
      chip.style.background = `rgba(var(--hot), ${(0.75 * Math.min(w / top, 1)).toFixed(3)})`;
      chip.classList.toggle("lit", w / top > 0.5);
      chip.title = `attention ${fmt(w)}`;
    }
    if (answered) {
      chip.type = "button";
      chip.setAttribute("aria-label", `answer token ${i - view.answer_start + 1}: ${pretty(token)}`);
      chip.addEventListener("click", () => chatAttention(i - view.answer_start).catch((e) => say("chat-status", e.message, true)));
    }
    return chip;
  });
  $("chat-tokens").replaceChildren(...chips);
  $("chat-tokens").dataset.token = view.token;
}

// ------------------------------------------------------------------------------ maps over time

// One head's map, or the mean of the heads' ("mean"). Shapes: heads [head][...] -> [...].
function headsOf(heads, head) {
  if (head !== "mean") return heads[Number(head)];
  const mean = (rows) => rows[0].map((_, j) => rows.reduce((a, r) => a + r[j], 0) / rows.length);
  return Array.isArray(heads[0][0]) ? heads[0].map((_, i) => mean(heads.map((h) => h[i]))) : mean(heads);
}

const transpose = (m) => (m.length ? m[0].map((_, j) => m.map((row) => row[j])) : []);

// The layer and head pickers of a view: the last layer, the heads' mean, at first.
function pickers(key, layers, heads) {
  const holder = document.querySelector(`[data-pickers="${key}"]`);
  if (!layers) return holder.replaceChildren();
  const redraw = () => (key === "chat" ? drawChatTokens() : drawTime(key));
  const layer = element("select", { id: `${key}-layer`, onchange: redraw }, ...range(layers).map((i) => element("option", { value: i, text: String(i + 1) })));
  const head = element("select", { id: `${key}-head`, onchange: redraw },
    element("option", { value: "mean", text: "mean of the heads" }), ...range(heads).map((h) => element("option", { value: h, text: String(h + 1) })));
  layer.value = String(layers - 1);
  holder.replaceChildren(element("label", {}, "Layer", layer), element("label", {}, "Head", head));
}

function redrawTime() {
  for (const key of Object.keys(views.figures)) drawTime(key);
}

// The spectrogram (time across, low frequencies at the bottom) and under it the map, rows the
// tokens, columns stretches of time, on one time axis; a token's row drawn over the spectrogram
// when it is chosen (click its row).
function drawTime(key) {
  const fig = views.figures[key];
  const holder = $(`${key}-figure`).querySelector(".time-canvas");
  if (!fig || $(`${key}-figure`).closest("[hidden]")) return;
  const layer = $(`${key}-layer`) ? Number($(`${key}-layer`).value) : 0;
  const head = $(`${key}-head`) ? $(`${key}-head`).value : "mean";
  const matrix = fig.matrix(layer, head);
  const top = Math.max(1e-9, ...matrix.map((row) => Math.max(...row)));
  const width = Math.max(240, holder.clientWidth);
  const g = { left: width < 500 ? 56 : 96, spec: width < 500 ? 96 : 150, axis: 20, row: fig.labels.length > 60 ? 9 : 15 };
  g.width = width;
  g.span = width - g.left - 4;
  g.height = g.spec + g.axis + g.row * fig.labels.length;
  const canvas = element("canvas", { role: "img", "aria-label": fig.caption });
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(g.height * ratio);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${g.height}px`;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  const x = (t) => g.left + (g.span * t) / Math.max(fig.seconds, 1e-9);
  spectrogram(ctx, fig, g);
  axis(ctx, fig, g, x);
  for (let r = 0; r < matrix.length; r++) {
    const y = g.spec + g.axis + r * g.row;
    matrix[r].forEach((w, c) => {
      const [a, b] = fig.cols[c];
      ctx.fillStyle = shade(w / top);
      ctx.fillRect(x(a), y, Math.max(1, x(b) - x(a)), g.row - 1);
      if (fig.selected === r) {
        ctx.fillStyle = `rgba(220, 38, 38, ${(0.7 * w / top).toFixed(3)})`;
        ctx.fillRect(x(a), 0, Math.max(1, x(b) - x(a)), g.spec);
      }
    });
    ctx.fillStyle = fig.selected === r ? "#dc2626" : "#1b1f24";
    ctx.font = `${g.row > 10 ? 12 : 8}px system-ui, sans-serif`;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.fillText(fig.labels[r].slice(0, width < 500 ? 7 : 12), g.left - 4, y + g.row / 2);
  }
  canvas.addEventListener("mousemove", (e) => readout(key, e, canvas, g, x, matrix));
  canvas.addEventListener("click", (e) => {
    const r = Math.floor((e.offsetY - g.spec - g.axis) / g.row);
    if (r >= 0 && r < matrix.length) {
      fig.selected = fig.selected === r ? null : r;
      drawTime(key);
    }
  });
  holder.replaceChildren(canvas);
  Object.assign(holder.dataset, { rows: matrix.length, cols: fig.cols.length, frames: fig.mel.length, top: fmt(top), layer, head });
  const which = fig.view.layers ? ` Layer ${layer + 1}, ${head === "mean" ? "the heads' mean" : `head ${Number(head) + 1}`}; colours from 0 to ${fmt(top)}.` : "";
  $(`${key}-caption`).textContent = `${fig.caption}.${which}`;
}

function shade(v) {
  const [r, g, b] = SHADES[Math.max(0, Math.min(255, Math.round(255 * v)))];
  return `rgb(${r}, ${g}, ${b})`;
}

function spectrogram(ctx, fig, g) {
  const frames = fig.mel.length;
  const bins = frames ? fig.mel[0].length : 0;
  if (!frames || !bins) return;
  let lo = Infinity;
  let hi = -Infinity;
  for (const row of fig.mel) for (const v of row) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  const image = new ImageData(frames, bins);
  for (let t = 0; t < frames; t++) {
    for (let m = 0; m < bins; m++) {
      const [r, gr, b] = SHADES[Math.round((255 * (fig.mel[t][m] - lo)) / Math.max(hi - lo, 1e-9))];
      const at = 4 * ((bins - 1 - m) * frames + t);
      image.data.set([r, gr, b, 255], at);
    }
  }
  const off = document.createElement("canvas");
  off.width = frames;
  off.height = bins;
  off.getContext("2d").putImageData(image, 0, 0);
  ctx.imageSmoothingEnabled = false;
  const shown = Math.min(1, (frames * fig.frameSeconds) / Math.max(fig.seconds, 1e-9)); // the frames' share of the axis
  ctx.drawImage(off, g.left, 0, g.span * shown, g.spec);
}

function axis(ctx, fig, g, x) {
  const step = [0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60].find((s) => (g.span * s) / Math.max(fig.seconds, 1e-9) >= 56) || 60;
  ctx.fillStyle = "#59636e";
  ctx.font = "11px system-ui, sans-serif";
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (let t = 0; t <= fig.seconds + 1e-9; t += step) {
    ctx.fillRect(x(t), g.spec, 1, 4);
    ctx.fillText(`${(fig.offset + t).toFixed(step < 0.1 ? 2 : step < 1 ? 1 : 0)} s`, x(t), g.spec + 5);
  }
}

function readout(key, e, canvas, g, x, matrix) {
  const fig = views.figures[key];
  const r = Math.floor((e.offsetY - g.spec - g.axis) / g.row);
  const t = ((e.offsetX - g.left) / g.span) * fig.seconds;
  const c = fig.cols.findIndex(([a, b]) => t >= a && t < b);
  if (r < 0 || r >= matrix.length || c < 0) return;
  const shown = `${fig.labels[r].trim() || "(space)"} at ${(fig.offset + t).toFixed(2)} s: ${fmt(matrix[r][c])}`;
  $(`${key}-readout`).textContent = shown;
  Object.assign($(`${key}-readout`).dataset, { r, c, w: fmt(matrix[r][c]) });
}
