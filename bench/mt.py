"""Translation quality benchmark (issue 3): train a recipe from scratch, translate its test
set, print BLEU beside the published figure.

    python bench/mt.py de-en [--out runs/bench-de-en] [--set train.epochs=10] [--resume]

Directions: de-en, en-de (Multi30k, test2016; en-de-lc trains on the lowercased tokenized
files) and zh-en, en-zh (Tatoeba, val: the source repository has no separate test set).
Printed, for each: the published-table metric (Multi30k: lowercased, Moses-tokenized BLEU
against the official ``tok/`` references; Tatoeba: sacreBLEU as the recipe says),
detokenized sacreBLEU with its signature, chrF, the training wall time, target tokens/s and
the whole command's wall time. The figures to beat are from the papers and repositories
named in issue 3 (not re-measured here).

``--ensemble N`` trains the recipe N times, with seeds seed, seed + 1, ... (run directories
OUT/seed-0, OUT/seed-1, ...), one after the other, and translates with the N final models as
one ensemble (``qkv translate --ensemble``: each step's distribution is the mean of theirs);
the recipe's training-time cap is for all N runs (each may use an equal share of what the runs
before it left: time a run did not need goes to the next), the training time printed is the
sum of the N runs', and each member's own BLEU is printed too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from qkv.checkpoint import RUN_FILE, load_model, model_dir  # noqa: E402
from qkv.data import read_parallel, resolve  # noqa: E402
from qkv.ensemble import Ensemble  # noqa: E402
from qkv.evaluation import corpus_scores  # noqa: E402
from qkv.loading import reading_as_trained  # noqa: E402
from qkv.memory import choose_allocator  # noqa: E402
from qkv.recipes import override  # noqa: E402
from qkv.seq2seq import beam_translate  # noqa: E402
from qkv.tasks import load_recipe  # noqa: E402
from qkv.tasks.translation import train_translation  # noqa: E402
from qkv.tokenization import Vocabularies  # noqa: E402

# direction -> recipe, test pairs, published-metric reference (tokenized, lowercased) or None,
# target language, sacreBLEU tokenizer, (target, who published the anchor)
BENCHES = {
    "de-en": (
        "multi30k_de_en.yaml",
        ("multi30k/test_2016_flickr.de", "multi30k/test_2016_flickr.en"),
        "multi30k/tok/test_2016_flickr.lc.norm.tok.en",
        "en",
        "13a",
        (38.0, "36.5: 3+3-layer d=256 Transformer, bentrevett/pytorch-seq2seq"),
    ),
    "en-de": (
        "multi30k_en_de.yaml",
        ("multi30k/test_2016_flickr.en", "multi30k/test_2016_flickr.de"),
        "multi30k/tok/test_2016_flickr.lc.norm.tok.de",
        "de",
        "13a",
        (42.0, "41.0: Transformer-tiny 4+4 d=128, Wu et al., ACL 2021"),
    ),
    "en-de-lc": (  # trained on the lowercased tokenized files: output is scored as it is
        "multi30k_en_de_lc.yaml",
        ("multi30k/tok/test_2016_flickr.lc.norm.tok.en", "multi30k/tok/test_2016_flickr.lc.norm.tok.de"),
        "multi30k/tok/test_2016_flickr.lc.norm.tok.de",
        "de",
        "none",
        (42.0, "41.0: Transformer-tiny 4+4 d=128, Wu et al., ACL 2021"),
    ),
    "zh-en": (
        "tatoeba_zh_en.yaml",
        ("tatoeba-zh-en/val.tsv", None),
        None,
        "en",
        "13a",
        (27.0, "26.95 on val: 3-layer d=256 Transformer, the data's source repository"),
    ),
    "en-zh": ("tatoeba_en_zh.yaml", ("tatoeba-zh-en/val.tsv", None), None, "zh", "zh", (None, "report only")),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=sorted(BENCHES))
    parser.add_argument("--out", help="run directory (default runs/bench-DIRECTION)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe value")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    parser.add_argument("--skip-training", action="store_true", help="score the finished run in --out")
    parser.add_argument("--ensemble", type=int, default=1, metavar="N", help="train N seeds, decode as one ensemble")
    args = parser.parse_args()
    if args.ensemble < 1:
        parser.error("--ensemble must be at least 1")
    print(f"allocator: {choose_allocator()}", flush=True)  # as qkv train does (memory.py)
    recipe_file, (test_src, test_tgt), tok_ref, lang, bleu_tok, (target, anchor) = BENCHES[args.direction]
    out = Path(args.out or ROOT / "runs" / f"bench-{args.direction}")
    recipe = load_recipe(ROOT / "recipes" / recipe_file, args.set)
    start = time.perf_counter()
    if args.ensemble == 1:
        summary = _trained(recipe, out, skip=args.skip_training, resume=args.resume)
        members = [summary]
    else:
        seed = recipe.train.seed
        # The recipe's training-time cap is for the whole ensemble (a --set train.seconds caps
        # each run instead): each run may use an equal share of what the runs before it left,
        # so N runs train no longer than one run may (validation and decoding come on top, N
        # times), and time a run did not need (it ended by its epochs) goes to the next.
        total = recipe.train.seconds if override(args.set, "train.seconds") is None else None
        members = []
        for k in range(args.ensemble):
            share = []
            if total is not None:
                left = total - sum(m["train_seconds"] for m in members)
                share = [f"train.seconds={left / (args.ensemble - k)}"]
            seeded = load_recipe(ROOT / "recipes" / recipe_file, [*args.set, *share, f"train.seed={seed + k}"])
            # --resume continues the members begun before and starts the others
            begun = (out / f"seed-{k}" / RUN_FILE).is_file()
            members.append(_trained(seeded, out / f"seed-{k}", skip=args.skip_training, resume=args.resume and begun))
            if not members[-1]["tokenizer"].same_as(members[0]["tokenizer"]):  # before training the next
                raise SystemExit(f"mt.py: {out / f'seed-{k}'} trained another vocabulary than {out / 'seed-0'}")
        seconds = sum(m["train_seconds"] for m in members)
        summary = {
            "model": Ensemble(tuple(m["model"] for m in members)),
            "tokenizer": members[0]["tokenizer"],
            "train_seconds": seconds,
            "tokens_per_second": sum(m["tokens_per_second"] * m["train_seconds"] for m in members) / seconds,
            "final": [m["final"] for m in members],
            "epochs": [m["epochs"] for m in members],
        }
    pairs = read_parallel(test_src, test_tgt) if test_tgt else read_parallel(test_src)
    if args.direction == "en-zh":
        pairs = [(b, a) for a, b in pairs]  # the TSV is zh<TAB>en
    sources, references = [a for a, _ in pairs], [b for _, b in pairs]
    # A cascade's translation model (data.source_as_transcript) reads what a recognizer writes.
    vocab = reading_as_trained(summary["tokenizer"], recipe.to_dict())

    def translated(model) -> list[str]:
        return beam_translate(
            model,
            vocab,
            sources,
            beam_size=recipe.decode.beam_size,
            length_penalty=float(recipe.decode.length_penalty),
            max_len_a=float(recipe.decode.max_len_a),
            max_len_b=recipe.decode.max_len_b,
        )

    def scored(hypotheses: list[str]) -> tuple[dict, dict | None, float]:
        """Detokenized sacreBLEU, the published-table metric (None without a tokenized
        reference) and the headline BLEU: the table's where there is one."""
        detok = corpus_scores(hypotheses, references, tokenize=bleu_tok)
        table = None if tok_ref is None else _table(hypotheses, tok_ref, bleu_tok=bleu_tok, lang=lang)
        return detok, table, (detok if table is None else table)["bleu"]

    t = time.perf_counter()
    hypotheses = translated(summary["model"])
    translate_seconds = time.perf_counter() - t
    (out / f"test.{lang}").write_text("\n".join(hypotheses) + "\n", encoding="utf-8")
    detok, table, headline = scored(hypotheses)
    result = {
        "direction": args.direction,
        "final_checkpoint": summary["final"],
        "epochs": summary["epochs"],
        "sacrebleu": detok["bleu"],
        "sacrebleu_signature": detok["bleu_signature"],
        "chrf": detok["chrf"],
        "train_seconds": round(summary["train_seconds"], 1),
        "tokens_per_second": round(summary["tokens_per_second"]),
        "translate_seconds": round(translate_seconds, 1),
    }
    if table is not None:
        result["published_metric_bleu"] = table["bleu"]
        result["published_metric_signature"] = table["bleu_signature"]
    if len(members) > 1:  # each member alone, for comparison (in the command's wall time)
        result["member_bleu"] = [scored(translated(m["model"]))[2] for m in members]
        result["member_train_seconds"] = [round(m["train_seconds"], 1) for m in members]
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))
    verdict = "" if target is None else ("  target met" if headline >= target else "  TARGET MISSED")
    goal = anchor if target is None else f"target >= {target}; published {anchor}"
    print(
        f"{args.direction}: qkv {headline} BLEU ({goal}){verdict} | "
        f"{'sacreBLEU' if bleu_tok != 'none' else 'BLEU on the tokenized text'} {detok['bleu']} "
        f"chrF {detok['chrf']} | training {result['train_seconds'] / 60:.1f} min, "
        f"{result['tokens_per_second']} target tokens/s | whole command {result['wall_seconds'] / 60:.1f} min"
    )
    if len(members) > 1:
        print(
            f"ensemble of {len(members)} (seeds {recipe.train.seed}..): members alone "
            + ", ".join(
                f"{b} BLEU ({t / 60:.1f} min)"
                for b, t in zip(result["member_bleu"], result["member_train_seconds"], strict=True)
            )
        )
    _record(args.direction, result, headline, target=target, anchor=anchor, table=table is not None)
    return 0


# direction -> what the headline figure is (the metric names of bench/results/mt.json)
METRICS = {
    "de-en": "Multi30k de→en, test2016: BLEU, lowercased tokenized",
    "en-de": "Multi30k en→de, test2016: BLEU, lowercased tokenized",
    "en-de-lc": "Multi30k en→de (en-de-lc), test2016: BLEU, lowercased tokenized",
    "zh-en": "Tatoeba zh→en, val: sacreBLEU",
    "en-zh": "Tatoeba en→zh, val: sacreBLEU (zh)",
}


def _record(direction: str, result: dict, headline: float, *, target, anchor: str, table: bool) -> None:
    """Append this run's headline BLEU to bench/results/mt.json (docs/results.md is rendered from it)."""
    from record import append  # bench/record.py, beside this script

    members = result.get("member_bleu")
    metric = METRICS[direction] + (f", ensemble of {len(members)}" if members else "")
    details = {"chrF": result["chrf"]}
    if table:
        details = {"sacreBLEU": result["sacrebleu"], **details}
    details.update(
        {
            "training (min)": round(result["train_seconds"] / 60, 1),
            "target tokens/s": result["tokens_per_second"],
            "whole command (min)": round(result["wall_seconds"] / 60, 1),
            "test translation (s)": result["translate_seconds"],
        }
    )
    for k, bleu in enumerate(members or []):
        details[f"member {k}"] = bleu
    anchor_figure, _, who = anchor.partition(": ")  # "26.95 on val: 3-layer d=256 Transformer, ..."
    append(
        "mt",
        {
            "metric": metric,
            "figure": headline,
            "unit": "BLEU",
            "peer": None if target is None else f"published anchor: {who}",
            "peer_figure": None if target is None else float(anchor_figure.split()[0]),
            "target": None if target is None else {"min": target},
            "details": details,
            "notes": f"Final checkpoint: {result['final_checkpoint']}; epochs: {result['epochs']}.",
        },
    )


def _trained(recipe: dict, out: Path, *, skip: bool, resume: bool) -> dict:
    """Train (or resume) the recipe in ``out``, or with ``skip`` (--skip-training) load its final model."""
    if not skip:
        return train_translation(recipe, out, resume=resume)
    model, meta = load_model(out)
    tokenizer = Vocabularies.load(model_dir(out), files=meta["files"])  # source and target
    run = json.loads((out / RUN_FILE).read_text())
    summary = {"model": model, "tokenizer": tokenizer, "train_seconds": run["seconds"], "steps": None}
    summary["tokens_per_second"] = run["tokens"] / max(run["seconds"], 1e-9)
    summary["final"], summary["epochs"] = run["final"], run["epoch"]
    return summary


def _table(hypotheses: list[str], tok_ref: str, *, bleu_tok: str, lang: str) -> dict:
    """The published-table metric against the official tokenized lowercased references:
    cased detokenized output gets the references' preprocessing; lowercased tokenized output
    (en-de-lc) already has it, and tokenizing it again would not be a no-op."""
    if bleu_tok == "none":
        return corpus_scores(hypotheses, _lines(tok_ref), tokenize="none", lowercase=True)
    return corpus_scores(hypotheses, _lines(tok_ref), tokenize="moses", lang=lang)


def _lines(path: str) -> list[str]:
    return resolve(path).read_text(encoding="utf-8").splitlines()


if __name__ == "__main__":
    from qkv.errors import UserError

    try:
        sys.exit(main())
    except UserError as e:  # a mistake in the command: one line, exit 2, as qkv's commands do
        print(f"mt.py: {e}", file=sys.stderr)
        sys.exit(2)
