"""``qkv train``: train any task from a recipe (the task module does the work; this prints the result).

What is here: the command's arguments (``add_parser``) beside its handler.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from qkv.cli.common import number
from qkv.errors import Stopped, UserError

EPILOG_TRAIN = """examples:
  qkv train recipes/numbers.yaml --out runs/numbers --set train.steps=1500 --set model.d_model=96
  qkv train recipes/shakespeare_char_cpu.yaml --out runs/shakespeare     # prints val_loss=...
  qkv train recipes/multi30k_de_en.yaml --out runs/de_en                 # a run: last/ best/ averaged/
  qkv train recipes/multi30k_de_en.yaml --out runs/de_en --resume        # continue after a stop or crash
  qkv train recipes/dailydialog_mlm.yaml --out runs/dailydialog_mlm      # BERT masked-LM pretraining
  qkv train recipes/dailydialog_acts.yaml --out runs/dailydialog_acts    # fine-tuned from it (train.init)
  qkv train recipes/multi30k_de_en.yaml --out runs/de_en --nproc 2       # 2 local workers (torchrun, DDP)
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
      -m qkv train recipes/multi30k_de_en.yaml --out runs/de_en          # on every machine (docs/distributed.md)
"""


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``qkv`` arguments every worker of ``--nproc`` runs: this command without ``--nproc``."""
    flags = [flag for flag, on in (("--resume", args.resume), ("--json", args.json), ("--quiet", args.quiet)) if on]
    return ["train", args.recipe, "--out", args.out, *[x for kv in args.set for x in ("--set", kv)], *flags]


def cmd_train(args: argparse.Namespace) -> int:
    from qkv import distributed, runner
    from qkv.plots import loss_curve
    from qkv.runs import TRAINER_STATE
    from qkv.tasks import TASKS, load_recipe

    if args.nproc < 1:
        raise UserError(f"--nproc must be a positive integer, got {args.nproc}")
    recipe = load_recipe(args.recipe, args.set)  # a bad recipe is said once, before any worker starts
    on = recipe.train.device
    distributed.device(on)  # train.device cuda without a GPU: said now, not after the data is read
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return distributed.launch(worker_argv(args), nproc=args.nproc, max_restarts=args.max_restarts, on=on)
    out = Path(args.out).resolve()
    task = TASKS[recipe.task]
    world = distributed.start(on=on)  # torchrun's environment: join the group (nothing for one process)
    # A group torchrun restarted after a failure continues the run from its last checkpoint.
    resume = args.resume or (distributed.restarted() and (out / "last" / TRAINER_STATE).is_file())
    try:
        summary = runner.train(task, recipe, out, progress=not args.quiet, resume=resume)
    except Stopped as e:
        again = [*sys.argv[1:]] if sys.argv[1:2] == ["train"] else ["train", args.recipe, "--out", args.out]
        again = again if "--resume" in again else [*again, "--resume"]
        if e.saved is None:
            raise
        raise Stopped(f"{e}; continue with: qkv {shlex.join(again)}", exit_code=e.exit_code, saved=e.saved) from None
    finally:
        distributed.finish()
    if not world.main:  # rank 0 reports; the other workers' part ended with training
        return 0
    for problem in summary.get("problems", []):
        print(f"qkv train: note: {problem}", file=sys.stderr)
    score, said = task.report(summary, recipe)
    loss_curve(summary["losses"], out / "loss.png", title=f"training loss: {args.recipe}", ylabel=task.loss_name)
    unit = task.rate_unit  # what the loss is over: examples (classify), masked tokens (mlm), tokens
    result = {
        "task": recipe.task,
        "model": str(out),
        "steps": summary["steps"],
        "train_seconds": round(summary["train_seconds"], 1),
        f"{unit}_per_second": round(summary["tokens_per_second"]),
        "final_loss": round(summary["final_loss"], 4),
        **score,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"trained {result['steps']} steps in {result['train_seconds']}s "
            f"({result[f'{unit}_per_second']} {unit.replace('_', ' ')}/s), "
            f"final training loss {result['final_loss']}, {said}; "
            f"model saved to {out}"
        )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``train`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "train",
        help="train a model from a recipe (YAML)",
        description="Train from a recipe: task, model config and training settings in YAML; any key can be "
        "overridden with --set section.key=value.",
        epilog=EPILOG_TRAIN,
        formatter_class=raw,
    )
    p.add_argument("recipe", help="recipe YAML file, e.g. recipes/numbers.yaml")
    p.add_argument("--out", required=True, help="model directory (translation: run directory) to write")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe value")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="train on N local worker processes started by torchrun (torch.distributed.run): DDP, or FSDP with "
        "--set train.parallel=fsdp; gloo on CPU, NCCL on GPU (default 1: no process group)",
    )
    p.add_argument(
        "--max-restarts",
        type=number(int, lambda v: v >= 0, "an integer >= 0"),
        default=0,
        metavar="K",
        help="with --nproc: let torchrun restart the workers K times after a failure; they continue from the "
        "last checkpoint (train.save_every)",
    )
    p.set_defaults(run=cmd_train)
