// qkv's page, the microphone's AudioWorklet (it runs on the browser's audio thread): the input's
// first channel resampled from the context's rate to 16 kHz and posted to the page as 16-bit
// signed little-endian samples (s16le, what /v1/audio/stream takes), about a tenth of a second
// a message; "flush" posts what is left. The resampling is band-limited interpolation (Smith,
// "Digital Audio Resampling"): each output sample is the input weighted by a Hann-windowed sinc
// whose cut-off is the lower of the two Nyquist frequencies, so a 48 kHz microphone's content
// above 8 kHz does not fold back into the speech band.
"use strict";

const OUT_RATE = 16000;
const ZEROS = 16; // the sinc's zero crossings on each side: its length, and how steep its cut-off
const PIECE = 1600; // output samples a message: 0.1 s

class Microphone extends AudioWorkletProcessor {
  constructor() {
    super();
    this.step = sampleRate / OUT_RATE; // input samples per output sample
    this.cut = Math.min(1, OUT_RATE / sampleRate); // the cut-off, a fraction of the input's Nyquist
    this.half = Math.ceil(ZEROS / this.cut); // the kernel's half-width, input samples
    this.input = new Float32Array(this.half); // zeros before the first sample: the kernel's left side
    this.first = -this.half; // the input index of input[0]
    this.t = 0; // the next output sample's time, in input samples
    this.out = [];
    this.port.onmessage = (e) => {
      if (e.data === "flush") {
        this.post();
        this.port.postMessage({ flushed: true });
      }
    };
  }

  kernel(u) {
    if (u === 0) return this.cut;
    if (Math.abs(u) >= this.half) return 0;
    const x = Math.PI * this.cut * u;
    return (this.cut * Math.sin(x) / x) * 0.5 * (1 + Math.cos((Math.PI * u) / this.half));
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel && channel.length) {
      const joined = new Float32Array(this.input.length + channel.length);
      joined.set(this.input);
      joined.set(channel, this.input.length);
      this.input = joined;
      this.resample();
    }
    return true; // keep running while the page holds the node
  }

  // Every output sample whose kernel the input received so far covers; the input it no longer needs dropped.
  resample() {
    const last = this.first + this.input.length - 1;
    while (this.t + this.half <= last) {
      const from = Math.ceil(this.t - this.half);
      const to = Math.floor(this.t + this.half);
      let sum = 0;
      for (let k = Math.max(from, this.first); k <= to; k++) sum += this.input[k - this.first] * this.kernel(this.t - k);
      this.out.push(sum);
      this.t += this.step;
      if (this.out.length >= PIECE) this.post();
    }
    const keep = Math.floor(this.t - this.half) - this.first;
    if (keep > 0) {
      this.input = this.input.slice(keep);
      this.first += keep;
    }
  }

  post() {
    if (!this.out.length) return;
    const bytes = new DataView(new ArrayBuffer(2 * this.out.length));
    this.out.forEach((x, i) => bytes.setInt16(2 * i, Math.round(Math.max(-1, Math.min(1, x)) * 32767), true));
    this.port.postMessage({ samples: bytes.buffer }, [bytes.buffer]);
    this.out = [];
  }
}

registerProcessor("qkv-microphone", Microphone);
