"""Decoding speed of two qkv source trees, side by side: a change against the commit before it.

    python bench/decode_ab.py --before /path/to/old/checkout --rounds 2

The rows (tokens/s, or audio seconds/s for speech) are the decoding rows that matter for a
refactor of the decoding engine: ``bench/mt_speed.py``'s base encoder-decoder (d=512, 8 heads,
6+6 layers, vocabulary 8,000; a decoding copy with stacked Q/K/V; 32 forced new tokens) greedy
at batch 1 and 32 and beam 5 at batch 8; ``bench/lm_speed.py``'s GPT (d=384, 6 layers, window
256) greedy generation of 255 tokens at batch 1 and 16; and a speech encoder-decoder with a CTC
head (d=256, 4+4 layers, 80 mels, Conv2d subsampling) decoding 8 utterances of 4 s with beam 4
joint with the CTC prefix score (λ = 0.3). Random weights, fixed seeds: both trees decode the
same models on the same inputs (checked: same outputs). Training rows: each tree's own
``qkv train`` on its own ``recipes/numbers.yaml`` and ``recipes/shakespeare_char_cpu.yaml`` for
a few hundred steps (its training tokens/s: the one loop, and its recipe layout, of each tree).

Each tree runs in a process of its own (``--worker SRC``), rounds alternating before / after, so
neither runs beside the other's threads or warm caches; a row's figure is its best over the
rounds. One record per row goes to ``bench/results/decode_ab.json`` (the after figure, the before
beside it as the peer).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def best_rate(run, amount: float, repeats: int = 3) -> tuple[float, object]:
    """``amount`` / the fastest of ``repeats`` runs after one warm-up, and the last output."""
    times, out = [], None
    for i in range(repeats + 1):
        start = time.perf_counter()
        out = run()
        if i:
            times.append(time.perf_counter() - start)
    return amount / min(times), out


def worker() -> dict:
    """Time every row with the qkv on sys.path (the caller put the tree's src/ first)."""
    import torch

    from qkv.decoding_copies import for_decoding
    from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
    from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig

    try:
        from qkv.decoding import beam_search, greedy
    except ImportError:  # the tree before the decoding engine
        from qkv.generation import beam_search, greedy

    torch.manual_seed(0)
    rows, outputs = {}, {}
    mt = EncoderDecoderConfig(
        src_vocab_size=8000,
        tgt_vocab_size=8000,
        d_model=512,
        n_heads=8,
        d_ff=2048,
        n_encoder_layers=6,
        n_decoder_layers=6,
        dropout=0.0,
    )
    model = EncoderDecoder(mt).eval()
    object.__setattr__(model.config, "eos_id", None)  # 32 forced new tokens, as bench/mt_speed.py
    model = for_decoding(model)
    for batch, beam in ((1, 1), (32, 1), (8, 5)):
        g = torch.Generator().manual_seed(batch * 10 + beam)
        sources = [
            torch.randint(4, 8000, (int(torch.randint(16, 33, (1,), generator=g)),), generator=g).tolist()
            for _ in range(batch)
        ]
        if beam == 1:
            rate, out = best_rate(lambda s=sources: greedy(model, s, max_new_tokens=32), batch * 32)
        else:
            rate, out = best_rate(
                lambda s=sources, w=beam: beam_search(model, s, beam_size=w, max_new_tokens=32), batch * 32
            )
            out = [h[0].tokens for h in out]
        rows[f"mt base {'greedy' if beam == 1 else f'beam {beam}'} batch {batch}"] = rate
        outputs[f"mt {batch} {beam}"] = out
    torch.manual_seed(0)
    gpt = DecoderOnlyConfig(vocab_size=65, d_model=384, n_heads=6, d_ff=1536, n_layers=6, max_len=256, dropout=0.0)
    lm = DecoderOnly(gpt).eval()
    object.__setattr__(lm.config, "eos_id", None)
    lm = for_decoding(lm)
    for batch in (1, 16):
        prompts = torch.randint(0, 65, (batch, 1), generator=torch.Generator().manual_seed(batch)).tolist()
        rate, out = best_rate(lambda p=prompts: greedy(lm, p, max_new_tokens=255), batch * 255, repeats=2)
        rows[f"gpt greedy batch {batch} (255 new)"] = rate
        outputs[f"gpt {batch}"] = out
    rows["asr beam 4 + ctc 0.3, 8 x 4 s"], outputs["asr"] = asr_rate(beam_search)
    return {"rows": rows, "outputs": outputs, "threads": torch.get_num_threads()}


# Training rows: the tree's own `qkv train` on its own shipped recipe (the one loop of each tree,
# the recipe layout of each), a few hundred steps; the rate is the summary's training tokens/s
# (validation and the final scoring excluded).
TRAINING = {
    "train numbers (enc-dec d64 2+2, batch 128), tokens/s": ("numbers.yaml", 400),
    "train shakespeare char (gpt d128 4 layers, batch 12), tokens/s": ("shakespeare_char_cpu.yaml", 800),
}


def training_rates(src: Path) -> dict[str, float]:
    """Each training row trained by the tree whose package is in ``src``, in a process of its own."""
    import os
    import tempfile

    rates = {}
    for row, (recipe, steps) in TRAINING.items():
        with tempfile.TemporaryDirectory() as tmp:
            argv = [sys.executable, "-m", "qkv", "train", str(src.parent / "recipes" / recipe), "--out", f"{tmp}/m"]
            argv += ["--set", f"train.steps={steps}", "--set", "train.seconds=null", "--quiet", "--json"]
            env = {**os.environ, "PYTHONPATH": str(src)}
            done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
            if done.returncode != 0:
                raise SystemExit(f"training {row} with {src} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rates[row] = float(next(v for k, v in result.items() if k.endswith("_per_second")))
    return rates


def asr_rate(beam_search) -> tuple[float, list]:
    """Audio seconds decoded per second: a speech model with a CTC head, beam 4, joint CTC."""
    import torch

    from qkv.audio import FeatureConfig
    from qkv.decoding_copies import for_decoding
    from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder

    torch.manual_seed(0)
    config = SpeechConfig(
        vocab_size=64,
        d_model=256,
        n_heads=4,
        d_ff=1024,
        n_encoder_layers=4,
        n_decoder_layers=4,
        features=FeatureConfig(n_mels=80),
        ctc=True,
        dropout=0.0,
        max_len=40,
    )
    model = for_decoding(SpeechEncoderDecoder(config).eval())
    g = torch.Generator().manual_seed(4)
    feats = [torch.randn(400, 80, generator=g) for _ in range(8)]  # 8 utterances of 4 s (10 ms frames)
    try:
        from qkv.decoding import joint_scorers

        weight, scorers = joint_scorers(ctc_weight=0.3)

        def run():
            return beam_search(model, feats, beam_size=4, max_new_tokens=40, decoder_weight=weight, scorers=scorers)
    except ImportError:

        def run():
            return beam_search(model, feats, beam_size=4, max_new_tokens=40, ctc_weight=0.3)

    rate, out = best_rate(run, 8 * 4.0, repeats=2)
    return rate, [h[0].tokens for h in out]


def run_tree(src: Path) -> dict:
    """One worker process for the tree whose package is in ``src``."""
    code = (
        f"import sys; sys.path.insert(0, {str(src)!r}); sys.path.insert(0, {str(ROOT / 'bench')!r}); "
        "import json, decode_ab; print(json.dumps(decode_ab.worker()))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"worker for {src} failed:\n{done.stderr[-3000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["rows"].update(training_rates(src))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the commit to compare with")
    parser.add_argument("--rounds", type=int, default=2, help="before/after rounds (each a process per tree)")
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args()
    trees = {"before": args.before.resolve() / "src", "after": ROOT / "src"}
    best: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    outputs = {}
    for r in range(args.rounds):
        for name, src in trees.items():
            found = run_tree(src)
            outputs[name] = found["outputs"]
            for row, rate in found["rows"].items():
                best[name][row] = max(rate, best[name].get(row, 0.0))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in found["rows"].items()), flush=True)
    same = outputs["before"] == outputs["after"]
    before_commit = subprocess.run(
        ["git", "-C", str(args.before), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"same outputs before and after: {same}")
    records = []
    for row, after in best["after"].items():
        before = best["before"][row]
        print(f"{row:<34} after {after:9.1f} | before {before:9.1f} | after / before {after / before:.3f}")
        unit = "audio s/s" if row.startswith("asr") else "tokens/s"
        records.append(
            {
                "metric": f"{'training' if row.startswith('train') else 'decoding'} speed, {row}",
                "figure": round(after, 1),
                "unit": unit,
                "peer": f"qkv before the change ({before_commit})",
                "peer_figure": round(before, 1),
                "notes": f"after / before {after / before:.3f}; best of {args.rounds} alternating rounds, each tree "
                f"in its own process; same outputs: {same}",
            }
        )
    if not args.no_record:
        from record import append_run

        append_run("decode_ab", records)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
