"""Data-parallel training on this machine (issue 24, section 3): the Multi30k recipe's model and
batches (recipes/multi30k_de_en.yaml: 3+3 layers, width 256, 2,500-token batches of real
Multi30k pairs under its joint 8,000-piece vocabulary), target tokens/s of

* 1 process × all cores' threads (qkv's single-process path, no process group),
* N processes × (cores / N) threads (``torchrun``, DDP over gloo: each worker its share of every
  batch, gradients all-reduced), and
* the same N processes with the all-reduce left out (DDP's ``no_sync`` on every step: wrong
  gradients, kept only as the time a step takes without communication),

so the communication share of a DDP step is 1 − (time without all-reduce) / (time with it).

    python bench/ddp.py                      # 2 workers, 30 timed steps after 5 warm-up (~5 min)
    python bench/ddp.py --steps 10 --no-record

Records go to bench/results/ddp.json. The GPU side of the issue is bench/gpu.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

WARM = 5  # warm-up steps, not timed


def prepare(path: Path, batches: int) -> None:
    """The recipe's vocabulary, model fields and its first ``batches`` token-budget batches, in JSON."""
    from qkv.data import batches_by_tokens, read_parallel
    from qkv.tasks import load_recipe
    from qkv.tasks.translation import _encode_pairs, vocabularies_for

    recipe = load_recipe(str(ROOT / "recipes" / "multi30k_de_en.yaml"), [])
    data = recipe.data
    pairs = read_parallel(*data.train)
    vocab, _ = vocabularies_for(data, checkpoint=None, pairs=pairs)
    window = int(recipe.model["max_len"])
    examples, _, _ = _encode_pairs(vocab, pairs, window=window, long="drop")
    lengths = [max(len(s), len(t) + 1) for s, t in examples]
    order = batches_by_tokens(lengths, max_tokens=recipe.train.max_tokens, seed=0)[:batches]
    target = vocab.target
    fields = {
        **recipe.model,
        "src_vocab_size": vocab.source.vocab_size,
        "tgt_vocab_size": target.vocab_size,
        "pad_id": target.pad_id,
        "bos_id": target.bos_id,
        "eos_id": target.eos_id,
    }
    batches_data = [[examples[i] for i in batch] for batch in order]
    path.write_text(json.dumps({"fields": fields, "batches": batches_data, "train": recipe.to_dict()["train"]}))


def worker(path: Path, mode: str, out: Path) -> None:
    """Train over the prepared batches; rank 0 writes target tokens/s and seconds per step."""
    from contextlib import nullcontext

    import torch

    from qkv import distributed
    from qkv.checkpoint import build_model
    from qkv.losses import seq2seq_batch, seq2seq_loss
    from qkv.training import Trainer

    world = distributed.start()
    prepared = json.loads(path.read_text())
    fields, train = prepared["fields"], prepared["train"]
    torch.manual_seed(0)
    model = build_model("encoder_decoder", fields)
    trainer = Trainer(model, lr=float(train["lr"]), warmup=int(train["warmup"]), total_steps=10**6)
    pad, bos, eos = fields["pad_id"], fields["bos_id"], fields["eos_id"]

    def loss_of(batch: list) -> tuple[torch.Tensor, int]:
        mine, counted = distributed.share(len(batch))
        s, t_in, t_out = seq2seq_batch([tuple(batch[i]) for i in mine], pad_id=pad, bos_id=bos, eos_id=eos)
        loss, n = seq2seq_loss(model, s, t_in, t_out, pad_id=pad, label_smoothing=0.1)
        return loss, n if counted else 0

    tokens, start = 0, 0.0
    for step, batch in enumerate(prepared["batches"]):
        if step == WARM:
            distributed.barrier()
            start, tokens = time.perf_counter(), 0
        # "nosync": the same step without DDP's all-reduce (the time of a step's computation alone).
        skip = trainer.runner.no_sync() if mode == "nosync" else nullcontext()
        with skip:
            _, n = trainer.step([lambda batch=batch: loss_of(batch)])
        tokens += n
    distributed.barrier()
    seconds = time.perf_counter() - start
    if world.main:
        steps = len(prepared["batches"]) - WARM
        out.write_text(json.dumps({"tokens_per_second": tokens / seconds, "seconds_per_step": seconds / steps}))
    distributed.finish()


def measure(prepared: Path, *, nproc: int, threads: int, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        me = [str(Path(__file__).resolve()), "--worker", str(prepared), mode, str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src")}
        if nproc == 1:
            argv = [sys.executable, *me]
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *me]
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"bench/ddp.py: {mode} with {nproc} process(es) failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(
        description="DDP on this machine: 1 process × all threads against N processes × the rest, Multi30k recipe.",
        epilog="example: python bench/ddp.py --nproc 2 --steps 30",
    )
    p.add_argument("--nproc", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--steps", type=int, default=30, help="timed steps after 5 warm-up (default 30)")
    p.add_argument("--no-record", action="store_true", help="print, do not write bench/results/ddp.json")
    p.add_argument("--worker", nargs=3, metavar=("PREPARED", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), args.worker[1], Path(args.worker[2]))
        return 0
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "batches.json"
        began = time.perf_counter()
        prepare(prepared, WARM + args.steps)
        print(f"prepared {WARM + args.steps} Multi30k batches in {time.perf_counter() - began:.0f}s", flush=True)
        single = measure(prepared, nproc=1, threads=cores, mode="sync")
        ddp = measure(prepared, nproc=args.nproc, threads=max(1, cores // args.nproc), mode="sync")
        alone = measure(prepared, nproc=args.nproc, threads=max(1, cores // args.nproc), mode="nosync")
    share = 1.0 - alone["seconds_per_step"] / ddp["seconds_per_step"]
    print(
        f"target tokens/s: 1 process x {cores} threads {single['tokens_per_second']:.0f} | "
        f"{args.nproc} processes x {max(1, cores // args.nproc)} thread(s), DDP {ddp['tokens_per_second']:.0f} "
        f"(ratio {ddp['tokens_per_second'] / single['tokens_per_second']:.2f}x); "
        f"communication share of a DDP step {share:.1%} "
        f"({ddp['seconds_per_step'] * 1000:.0f} ms with the all-reduce, "
        f"{alone['seconds_per_step'] * 1000:.0f} ms without)"
    )
    if not args.no_record:
        from record import append_run

        append_run(
            "ddp",
            [
                {
                    "metric": f"Multi30k recipe training, {args.nproc} DDP processes x {max(1, cores // args.nproc)} "
                    f"thread(s) (gloo)",
                    "figure": round(ddp["tokens_per_second"]),
                    "unit": "target tokens/s",
                    "peer": f"qkv, 1 process x {cores} threads",
                    "peer_figure": round(single["tokens_per_second"]),
                    "target": None,
                    "details": {
                        "steps timed": args.steps,
                        "communication share of a step": round(share, 3),
                        "ms per step with all-reduce": round(ddp["seconds_per_step"] * 1000),
                        "ms per step without": round(alone["seconds_per_step"] * 1000),
                    },
                }
            ],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
