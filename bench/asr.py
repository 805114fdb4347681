"""Speech benchmarks: each recipe trained here from scratch on the CPU, scored on its test split,
beside the peer the issue names, with the wall time (corpus building included).

    python bench/asr.py fsdd --whisper /tmp/whisper-tiny.en     # FSDD digits vs Whisper tiny.en
    python bench/asr.py fsdd --model runs/fsdd_digits           # score a model trained before
    python bench/asr.py digit_strings --held-out theo           # digit strings, an unheard speaker
    python bench/asr.py speech_en                               # espeak-ng English, unseen voices
    python bench/asr.py speech_de_en                            # German speech -> English text
    python bench/asr.py speech_de                               # German speech recognition
    python bench/asr.py speech_de_en --model runs/speech_de_en --cascade runs/speech_de runs/de_en_mt
    python bench/asr.py speech_en --model runs/speech_en --lm runs/speech_en_lm --lm-weight 0.3
    python bench/asr.py speech_en --pipeline --lm-weight 0.5    # recognizer + its LM, one run
    python bench/asr.py speech_de_en --pipeline                  # recognizer, translator, end to end

``fsdd``: ``recipes/fsdd_digits.yaml``; the figure is the share of the 300 test files (recordings
0–4 of every digit and speaker) transcribed exactly right (target ≥ 97%). With ``--whisper DIR``
(an HF Whisper checkpoint: ``bench/fetch_whisper_tiny.sh`` fetches tiny.en) the same 300 files go
through transformers' Whisper (``bench/whisper_fsdd.py``), plain and with 0.5 s of silence added,
and its accuracy is the peer figure. ``digit_strings``: WER on the held-out speaker (≤ 10%).
``speech_en``: WER on test2016 spoken by voice variants never trained on (≤ 10%).
``speech_de_en``: end-to-end BLEU (sacreBLEU 13a, lowercased; ≥ 25). With ``--cascade ASR MT``
the same test utterances also go through the cascade, German speech recognition
(``recipes/speech_de.yaml``) then qkv's de->en translation (``recipes/speech_de_en_mt.yaml``,
trained on sources as the recognizer writes them; the same model can start the end-to-end
model's decoder), scored the same way and printed beside it (the German WER is recorded too). ``speech_de``: the
cascade's German recognizer on its own, WER on test2016 spoken by unseen voice variants.

With ``--pipeline`` (``speech_en``, ``speech_de_en``) every model the figure needs is trained in
one run, each stage in its own directory under ``--out`` with the budget of :data:`PIPELINES`,
so that the wall time is the whole cost of the figure: for English the recognizer, then the
language model in its tokens, scored with and without it fused; for speech translation the
German recognizer, then the translator, then the end-to-end model started from both, scored
beside the cascade of the first two. ``--set`` then applies to every stage (``train.seconds=30``
for a quick check), or, written ``STAGE:KEY=VALUE``, to that stage alone
(``speech_en:data.test_limit=50``).

With ``--lm DIR`` (and ``--model``) the test set is decoded with that language model fused into
the beam search (``recipes/speech_en_lm.yaml``) and, as the peer, by the same model without it.

Without ``--model`` the recipe is trained into ``--out`` (default ``runs/bench_<name>``); the
wall time covers building (or finding in the cache) the corpus, computing features, training
and scoring. With ``--model`` the model is scored again and its recorded training time is
reported. ``--set`` overrides recipe keys (a shorter run, say). Records go to
``bench/results/asr.json`` (``--no-record``: print only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from qkv import runner  # noqa: E402
from qkv.cli.transcribe import LM_WEIGHT  # noqa: E402

BENCHES = {
    # name: (recipe, metric, unit, target)
    "fsdd": ("fsdd_digits", "FSDD digits, standard test split (300 files): utterances right", "%", {"min": 97}),
    "digit_strings": ("fsdd_digit_strings", "FSDD digit strings, held-out speaker: WER", "%", {"max": 10}),
    "speech_en": ("speech_en", "espeak-ng English, Multi30k test2016, unseen voices: WER", "%", {"max": 10}),
    "speech_de_en": ("speech_de_en", "German speech -> English text, Multi30k test2016: BLEU", "BLEU", {"min": 25}),
    # The cascade's first half (no target of its own): its model is --cascade's ASR.
    "speech_de": ("speech_de", "espeak-ng German, Multi30k test2016, unseen voices: WER", "%", None),
}

# The stages a --pipeline run trains, in order: (directory under --out, recipe, its overrides);
# "{name}" in an override is the directory of the stage of that name. The budgets are chosen so
# that the whole run, building the corpus included, fits the 90 minutes on 2 cores:
# English: corpus about 10 min, features 2, recognizer 50, language model 20, scoring 3.
# German -> English: corpus and features about 20 min, recognizer 20 (bf16), translator 12,
# end-to-end model 28 (started from the recognizer's encoder and the translator's decoder), the
# stages' features 4, scoring 3.
PIPELINES = {
    "speech_en": (
        ("speech_en", "speech_en", ("train.seconds=3000",)),
        ("speech_en_lm", "speech_en_lm", ("train.seconds=1200", "data.tokenizer={speech_en}")),
    ),
    "speech_de_en": (
        ("speech_de", "speech_de", ("train.seconds=1200", "train.bf16=true")),
        ("de_en_mt", "speech_de_en_mt", ("train.seconds=720",)),
        (
            "speech_de_en",
            "speech_de_en",
            ("train.seconds=1680", "train.init_encoder={speech_de}", "train.init_decoder={de_en_mt}"),
        ),
    ),
}


def finished(directory: Path) -> bool:
    """Whether a pipeline stage's directory holds a finished run: a model saved by the end of a
    run (config.json, no ``last/`` checkpoint left), or a translation run whose run.json has its
    final scores."""
    if (directory / "config.json").is_file() and not (directory / "last").exists():
        return True
    run = directory / "run.json"
    return run.is_file() and "final_scores" in json.loads(run.read_text(encoding="utf-8"))


def stage_sets(stage: str, items: list[str]) -> list[str]:
    """The ``--set`` items of a pipeline stage: those without a stage, and ``STAGE:KEY=VALUE``'s."""
    chosen = []
    for item in items:
        head, colon, rest = item.partition(":")
        if not colon or "=" in head:  # no stage named (a colon after "=" is the value's)
            chosen.append(item)
        elif head == stage:
            chosen.append(rest)
    return chosen


def run_pipeline(name: str, args: argparse.Namespace) -> dict[str, float | None]:
    """Train the stages of ``PIPELINES[name]`` into ``args.out``, one after another (``--set``
    applies to each, ``STAGE:KEY=VALUE`` to one), and point ``args`` at what they made
    (``--model`` and ``--lm`` or ``--cascade``) for scoring. Returns each stage's wall seconds
    (None: a stage ``--resume`` found finished, trained by an earlier run)."""
    from qkv.tasks import TASKS, load_recipe

    out = Path(args.out or ROOT / "runs" / f"bench_{name}_pipeline")
    dirs = {stage: str(out / stage) for stage, _, _ in PIPELINES[name]}
    seconds = {}
    for stage, recipe_name, overrides in PIPELINES[name]:
        began = time.perf_counter()
        filled = [override.format(**dirs) for override in overrides]
        recipe = load_recipe(ROOT / "recipes" / f"{recipe_name}.yaml", [*filled, *stage_sets(stage, args.set)])
        directory = Path(dirs[stage])
        if args.resume and finished(directory):  # --resume continues where the pipeline stopped
            print(f"pipeline stage {stage}: trained already in {directory}", flush=True)
            seconds[stage] = None  # its cost is not in this run's wall time
            continue
        print(f"pipeline stage {stage}: recipes/{recipe_name}.yaml {' '.join(filled)}", flush=True)
        runner.train(TASKS[recipe.task], recipe, directory, progress=True, resume=args.resume and directory.exists())
        seconds[stage] = round(time.perf_counter() - began, 1)
    if name == "speech_en":
        args.model, args.lm = dirs["speech_en"], dirs["speech_en_lm"]
    else:
        args.model, args.cascade = dirs["speech_de_en"], [dirs["speech_de"], dirs["de_en_mt"]]
    return seconds


def train_or_load(name: str, args: argparse.Namespace) -> tuple[dict, float | None]:
    """The scores of the trained model on its test split, and the seconds it took
    (train + score; or, for ``--model``, the recorded training time)."""
    from qkv.checkpoint import load_model, model_dir
    from qkv.tasks import TASKS, load_recipe
    from qkv.tasks.asr import score_model
    from qkv.tokenization import FILE, Tokenizer

    recipe_name = BENCHES[name][0]
    overrides = [] if args.pipeline else list(args.set)  # a pipeline's went to its stages
    if name == "digit_strings":
        overrides.append(f"data.held_out={args.held_out}")
    recipe = load_recipe(ROOT / "recipes" / f"{recipe_name}.yaml", overrides)
    if args.model is None:
        out = Path(args.out or ROOT / "runs" / f"bench_{name}")
        start = time.perf_counter()
        summary = runner.train(TASKS["asr"], recipe, out, progress=True, resume=args.resume)
        return summary, time.perf_counter() - start
    path = model_dir(args.model)
    model, meta = load_model(path, kind="speech_encoder_decoder")
    recipe = TASKS["asr"].from_stored(meta["recipe"]) if meta.get("recipe") else recipe
    tokenizer = Tokenizer.load(path / FILE)
    if args.lm:
        from qkv.loading import load_fusion_lm

        lm = load_fusion_lm(args.lm, tokenizer, model=model)
        summary = score_model(model, tokenizer, recipe, lm=lm, lm_weight=args.lm_weight)
        summary["without_lm"] = score_model(model, tokenizer, recipe)
    else:
        summary = score_model(model, tokenizer, recipe)
    summary["init_encoder"], summary["init_decoder"] = meta.get("init_encoder"), meta.get("init_decoder")
    # A model saved before these were recorded has none: they are left out, never made up.
    for key, name in (("train_seconds", "train_seconds"), ("audio_seconds_per_second", "tokens_per_second")):
        if key in meta:
            summary[name] = meta[key]
    return summary, meta.get("wall_seconds")


def cascade(asr_dir: Path, mt_dir: Path, limit: int) -> dict:
    """BLEU of German speech recognition followed by de->en translation on the first ``limit``
    test utterances of the German corpus (those the end-to-end model was scored on), and the
    recognizer's German WER. The translation model reads what the recognizer writes (normalised
    transcripts: lowercase, no punctuation), as a cascade does."""
    from qkv.checkpoint import load_model, model_dir, read_meta
    from qkv.evaluation import corpus_scores
    from qkv.loading import load_for_generation
    from qkv.seq2seq import beam_translate
    from qkv.tasks import TASKS
    from qkv.tasks.asr import score_model
    from qkv.tasks.asr_data import load_corpus, output_text
    from qkv.tokenization import FILE, Tokenizer

    asr_path = model_dir(asr_dir)
    asr, meta = load_model(asr_path, kind="speech_encoder_decoder")
    recipe = TASKS["asr"].from_stored(meta["recipe"])
    if recipe.data.corpus != "espeak_de" or recipe.data.translate:
        raise SystemExit(f"{asr_path}: the cascade needs German speech recognition (recipes/speech_de.yaml)")
    recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, test_limit=limit))
    german = score_model(asr, Tokenizer.load(asr_path / FILE), recipe)
    corpus, split = load_corpus(recipe.data)
    references = [output_text(u, translate=True, normalize=False) for u in corpus[split][:limit]]
    mt, vocab = load_for_generation(str(mt_dir))
    english = beam_translate(mt, vocab, german["hypotheses"], beam_size=4)
    bleu = corpus_scores(english, references, tokenize="13a", lowercase=True)
    # Whether the translation model learnt on sources like the transcripts it reads here.
    data = (read_meta(mt_dir).get("recipe") or {}).get("data", {})  # a run directory: its final model
    return {"bleu": bleu["bleu"], "wer": german["wer"], "mt_reads_transcripts": bool(data.get("source_as_transcript"))}


def pipeline_said(name: str) -> str:
    """What a record's notes say of a --pipeline run's stages: their recipes and overrides."""
    return "; then ".join(
        f"recipes/{recipe}.yaml" + (f" ({', '.join(overrides)})" if overrides else "")
        for _, recipe, overrides in PIPELINES[name]
    )


def started_from(summary: dict) -> str:
    """What a record's notes say of where the model's parts started."""
    pairs = (("encoder", "init_encoder"), ("decoder", "init_decoder"))
    said = [f"{part} from {summary[key]}" for part, key in pairs if summary.get(key)]
    return ", " + ", ".join(said) if said else " from scratch"


def main() -> int:
    p = argparse.ArgumentParser(
        description="Speech benchmarks: train a speech recipe here, score it beside its peer, record it.",
        epilog="example: python bench/asr.py fsdd --whisper /tmp/whisper-tiny.en",
    )
    p.add_argument("bench", choices=sorted(BENCHES))
    p.add_argument("--model", help="score this trained model instead of training one")
    p.add_argument("--out", help="where to train (default runs/bench_NAME)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe value")
    p.add_argument("--held-out", default="theo", help="digit_strings: the speaker held out (default theo)")
    p.add_argument("--whisper", help="fsdd: an HF Whisper checkpoint directory to run on the same files")
    p.add_argument(
        "--cascade",
        nargs=2,
        metavar=("ASR", "MT"),
        help="speech_de_en: also score German speech recognition (ASR) then de->en translation (MT)",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="speech_en, speech_de_en: train every model the figure needs in one run (see PIPELINES)",
    )
    p.add_argument("--lm", help="with --model: a language model fused into the beam search (peer: no LM)")
    p.add_argument("--lm-weight", type=float, help=f"the --lm weight (default {LM_WEIGHT}, as qkv transcribe's)")
    p.add_argument("--no-record", action="store_true", help="print, do not write bench/results/asr.json")
    args = p.parse_args()
    from qkv.memory import choose_allocator

    # As qkv train does (memory.py): on glibc's malloc a fifth of training went to the kernel.
    print(f"allocator: {choose_allocator()}", flush=True)
    if args.pipeline and (args.bench not in PIPELINES or args.model or args.lm or args.cascade):
        p.error(f"--pipeline trains every model itself: {' or '.join(PIPELINES)}, without --model, --lm, --cascade")
    if args.pipeline:
        stages = [stage for stage, _, _ in PIPELINES[args.bench]]
        for item in args.set:
            head, colon, _ = item.partition(":")
            if colon and "=" not in head and head not in stages:
                p.error(f"--set {item}: {head} is not a stage of the {args.bench} pipeline ({', '.join(stages)})")
    if args.lm and not args.model:
        p.error("--lm scores a trained model: give --model too")
    fused = args.lm or (args.pipeline and args.bench == "speech_en")  # the English pipeline trains its LM
    if args.lm_weight is not None and (not fused or args.lm_weight < 0):
        p.error("--lm-weight is a weight >= 0 of an --lm (or of the speech_en pipeline's)")
    args.lm_weight = LM_WEIGHT if args.lm_weight is None else args.lm_weight
    if args.lm and (args.cascade or args.whisper):
        p.error("--lm has the model without it as its peer: not with --cascade or --whisper")

    name = args.bench
    _, metric, unit, target = BENCHES[name]
    began = time.perf_counter()
    if args.pipeline:
        from qkv.speech_corpora import cache_root

        cached = sorted(p.name for p in cache_root().glob("speech/*") if p.is_dir()) if cache_root().is_dir() else []
        stages = run_pipeline(name, args)
    summary, wall = train_or_load(name, args)
    if name == "speech_de_en":
        figure = summary["bleu"]
    elif name == "fsdd":
        figure = 100 * summary["accuracy"]
    else:
        figure = 100 * summary["wer"]
    if name == "digit_strings":
        metric = f"{metric} ({args.held_out})"
    details = {
        k: round(summary[k], 4)
        for k in ("wer", "cer", "accuracy", "bleu", "chrf", "train_seconds", "eval_seconds")
        if isinstance(summary.get(k), float | int)
    }
    if "tokens_per_second" in summary:
        details["training audio seconds per second"] = round(summary["tokens_per_second"], 1)
    details["decoding audio seconds per second"] = round(summary["decode_audio_seconds_per_second"], 1)
    if wall is not None:
        details["wall seconds (corpus, features, training, scoring)"] = round(wall, 1)
    details["test utterances"] = summary["test_utterances"]
    peer, peer_figure = None, None
    if name == "fsdd" and args.whisper:
        from whisper_fsdd import whisper_fsdd

        files, refs = [Path(p) for p in summary["paths"]], summary["references"]
        plain = whisper_fsdd(Path(args.whisper), files, refs)
        padded = whisper_fsdd(Path(args.whisper), files, refs, silence_seconds=0.5)
        peer, peer_figure = f"Whisper ({Path(args.whisper).name}) on the same files", 100 * plain["accuracy"]
        details["Whisper, 0.5 s of silence added"] = round(100 * padded["accuracy"], 2)
    if args.lm:
        alone = summary["without_lm"]
        metric = f"{metric}, language model fused (weight {args.lm_weight})"
        peer = "the same model without the language model"
        if name == "speech_de_en":
            peer_figure = alone["bleu"]
        else:
            peer_figure = 100 * alone["accuracy" if name == "fsdd" else "wer"]
        details["language model"] = args.lm
    if name == "speech_de_en" and args.cascade:
        chained = cascade(Path(args.cascade[0]), Path(args.cascade[1]), summary["test_utterances"])
        peer, peer_figure = "the cascade: qkv German ASR, then qkv de->en translation", chained["bleu"]
        details["cascade: German ASR WER (%)"] = round(100 * chained["wer"], 2)
        details["cascade models"] = list(args.cascade)
        details["cascade MT trained on transcript-like sources"] = chained["mt_reads_transcripts"]
    if args.pipeline:
        wall = time.perf_counter() - began  # every stage, its corpus and features, and the scoring
        details["wall seconds (corpus, features, training, scoring)"] = round(wall, 1)
        details["pipeline stages (wall seconds each)"] = stages
        details["pipeline overrides"] = {stage: list(overrides) for stage, _, overrides in PIPELINES[name]}
        details["corpora cached before the run"] = cached
    print(f"{metric}: qkv {figure:.2f} {unit}" + (f"  |  {peer}: {peer_figure:.2f} {unit}" if peer else ""))
    if "train_seconds" in summary and wall is not None:
        print(
            f"trained {summary['train_seconds'] / 60:.1f} min at "
            f"{summary['tokens_per_second']:.0f} audio s/s; whole run {wall / 60:.1f} min"
        )
    if not args.no_record:
        import record

        records = [
            {
                "metric": metric,
                "figure": round(figure, 2),
                "unit": unit,
                "peer": peer,
                "peer_figure": None if peer_figure is None else round(peer_figure, 2),
                "target": target,
                "details": details,
                "notes": (
                    f"one run trained every stage on this machine's CPU: {pipeline_said(name)}"
                    if args.pipeline
                    else f"recipe recipes/{BENCHES[name][0]}.yaml, trained on this machine's CPU"
                    + started_from(summary)
                ),
            },
        ]
        if "tokens_per_second" in summary:  # a model saved before it was recorded has none
            throughput = {
                "metric": f"{BENCHES[name][0]}: training throughput",
                "figure": round(summary["tokens_per_second"], 1),
                "unit": "audio seconds/s",
                "details": {"steps": summary.get("steps")},
            }
            records.append(throughput)
        record.append_run("asr", records)
    return 0


if __name__ == "__main__":
    from qkv.errors import UserError

    try:
        sys.exit(main())
    except UserError as e:  # a mistake in the command: one line, exit 2, as qkv's commands do
        print(f"asr.py: {e}", file=sys.stderr)
        sys.exit(2)
