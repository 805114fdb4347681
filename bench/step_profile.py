"""Where a decoding step's time goes (issue 49): the base translation model of ``bench/mt_speed.py``
(d=512, 6+6 layers, vocabulary 8,000), 32 forced new tokens, greedy at batch 1 and beam 5 at
batch 8, profiled with ``torch.profiler`` and each operator's own time put in one bucket:

    projections    matrix products of the layers' weights (Q/K/V, output, feed-forward)
    output layer   the vocabulary projection (a product with 8,000 outputs)
    attention      fused attention, softmax, and attention's own batched products
    cache          KV-cache writes and beam reordering (copies, index_select, cat, slices)
    top-k          log-softmax, top-k, argmax, sort
    other ops      every other operator (norms, activations, adds, embedding)
    Python         wall time minus the operators' time: the interpreter, the search's bookkeeping
                   (and the profiler's own cost per call, a few microseconds: compare rows, not totals)

in milliseconds per step (one step = one new token for every hypothesis), for two layouts of
the float32 decoding copy: ``for_decoding(model)`` (weights as ``nn.Linear`` stores them) and
``for_decoding(model, wide=True)`` (widening layers stored transposed, what ``qkv translate``
loads on the CPU), and with ``--also`` the ``--bf16`` and ``--int8`` copies (their int8 kernels
count as projections). All in this process, one after another, after a warm-up.

    python bench/step_profile.py                 # a minute or two
    python bench/step_profile.py --no-record
    python bench/step_profile.py --also bf16 int8 --no-record     # the --bf16 and --int8 copies too
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mt_speed
import record

from qkv.decoding import beam_search, greedy
from qkv.decoding_copies import for_decoding
from qkv.loading import prepared
from qkv.memory import choose_allocator

NEW = 32
BUCKETS = ("projections", "output layer", "attention", "cache", "top-k", "other ops", "Python")
ATTENTION = ("scaled_dot_product", "softmax", "bmm", "baddbmm")
CACHE = ("copy_", "index_select", "index_copy", "cat", "slice_scatter", "gather", "index", "narrow", "clone")
TOPK = ("topk", "log_softmax", "argmax", "sort", "max")


def bucket(name: str, shapes: list) -> str:
    """The bucket of one operator call, by its name and (for products) its weight's shape."""
    op = name.removeprefix("aten::")
    if op in ("_weight_int8pack_mm", "quantized::linear_dynamic"):  # int8 layers (qkv.int8), never the output layer
        return "projections"
    if op in ("mm", "addmm", "linear", "matmul"):
        width = shapes[1][-1] if len(shapes) > 1 and shapes[1] else 0
        return "output layer" if width == mt_speed.VOCAB else "projections"
    if any(op.startswith(a) for a in ATTENTION):
        return "attention"
    if op in CACHE:
        return "cache"
    if op in TOPK:
        return "top-k"
    return "other ops"


def leaf_times(prof) -> dict[str, float]:
    """Self CPU milliseconds per bucket over the profiled run."""
    out = dict.fromkeys(BUCKETS, 0.0)
    for event in prof.key_averages(group_by_input_shape=True):
        if event.self_cpu_time_total > 0:
            out[bucket(event.key, event.input_shapes)] += event.self_cpu_time_total / 1e3
    return out


@torch.no_grad()
def profiled(model, batch: int, beam: int) -> dict[str, float]:
    """Milliseconds per step in each bucket, and the step's wall time."""
    inputs = mt_speed.sources(batch, beam)

    def run():
        if beam == 1:
            return greedy(model, inputs, max_new_tokens=NEW)
        return beam_search(model, inputs, beam_size=beam, max_new_tokens=NEW)

    run()  # warm-up
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        run()
        wall = (time.perf_counter() - start) * 1e3
    times = leaf_times(prof)
    times["Python"] = max(wall - sum(times.values()), 0.0)
    return {k: v / NEW for k, v in times.items()} | {"step": wall / NEW}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--also", nargs="*", default=[], choices=["bf16", "int8"], help="also profile these copies")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--notes", default="")
    args = parser.parse_args()
    choose_allocator()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = mt_speed.qkv_model(mt_speed.SIZES["base"], dropout=0.0).eval()
    object.__setattr__(model.config, "eos_id", None)  # exactly NEW tokens
    layouts = {"nn.Linear layout": for_decoding(model), "widening layers transposed": for_decoding(model, wide=True)}
    for precision in args.also:  # as qkv translate --bf16 / --int8 loads them
        layouts[f"{precision} copy"] = prepared(model, "encoder_decoder", **{precision: True})
    records = []
    for batch, beam, what in ((1, 1, "greedy batch 1"), (8, 5, "beam 5 batch 8")):
        rows = {name: profiled(m, batch, beam) for name, m in layouts.items()}
        print(f"{what}: ms per step")
        print(f"  {'':28s}" + "".join(f"{b:>13s}" for b in (*BUCKETS, "step")))
        for name, row in rows.items():
            print(f"  {name:28s}" + "".join(f"{row[b]:13.3f}" for b in (*BUCKETS, "step")))
            records += [
                {"metric": f"{what} {name}: {b} ms per step", "figure": round(row[b], 3), "unit": "ms"}
                for b in (*BUCKETS, "step")
            ]
    if not args.no_record:
        notes = f"{args.notes} {args.threads} threads; torch.profiler self CPU time per bucket".strip()
        record.append_run("step_profile", [r | {"notes": notes} for r in records])


if __name__ == "__main__":
    main()
