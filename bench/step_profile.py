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
count as projections), each beside the same copy with its bfloat16 products through ``F.linear``
(weights reordered on every call: what they were before ``layers.PackedLinear``). All in this
process after a warm-up; with ``--rounds`` the layouts alternate that many times and each bucket
is the median (for a machine shared with other jobs).

    python bench/step_profile.py                 # a minute or two
    python bench/step_profile.py --no-record
    python bench/step_profile.py --also bf16 int8 --no-record     # the --bf16 and --int8 copies too
    python bench/step_profile.py --also bf16 int8 --rounds 5 --threads 1 --no-record   # on a busy machine
    python bench/step_profile.py --also int8 --batch32 --no-record     # greedy at batch 32 too (issue 49)

With ``--batch32``, greedy at batch 32 is profiled too (a step of many rows: the int8 copy's
GEMM path, ``qkv.int8.Int8Linear``); the int8 layers' own operators around fbgemm's kernel
(each row's max, the division, the scaling back) count as "other ops".
"""

from __future__ import annotations

import argparse
import statistics
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
from qkv.int8 import Bf16Linear
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
    if op in ("mm", "addmm", "linear", "matmul", "mkldnn::_linear_pointwise"):
        weight = shapes[1] if len(shapes) > 1 and shapes[1] else [0]
        width = weight[0] if op.startswith("mkldnn") else weight[-1]  # a packed weight (layers.PackedLinear) is (N, K)
        return "output layer" if width == mt_speed.VOCAB else "projections"
    bare = op.lstrip("_")  # aten's kernels: _scaled_dot_product_flash_attention_for_cpu, _log_softmax
    if any(bare.startswith(a) for a in ATTENTION):
        return "attention"
    if bare in CACHE:
        return "cache"
    if bare in TOPK:
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


def unpacked(model, precision: str):
    """The ``precision`` copy as ``prepared`` made it before ``layers.PackedLinear``: bfloat16
    products through ``F.linear`` (the bf16 copy's every linear layer, the int8 copy's output)."""
    if precision == "bf16":
        return for_decoding(model).to(torch.bfloat16).eval()
    copy = prepared(model, "encoder_decoder", int8=True)
    copy.output = Bf16Linear(model.output)
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--also", nargs="*", default=[], choices=["bf16", "int8"], help="also profile these copies")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the layouts this many times; medians")
    parser.add_argument("--batch32", action="store_true", help="also greedy at batch 32")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--notes", default="")
    args = parser.parse_args()
    choose_allocator()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = mt_speed.qkv_model(mt_speed.SIZES["base"], dropout=0.0).eval()
    object.__setattr__(model.config, "eos_id", None)  # exactly NEW tokens
    layouts = {"nn.Linear layout": for_decoding(model), "widening layers transposed": for_decoding(model, wide=True)}
    for precision in args.also:  # as qkv translate --bf16 / --int8 loads them, and with F.linear's bf16 products
        layouts[f"{precision} copy"] = prepared(model, "encoder_decoder", **{precision: True})
        layouts[f"{precision} copy, F.linear"] = unpacked(model, precision)
    records = []
    cases = [(1, 1, "greedy batch 1"), (8, 5, "beam 5 batch 8")] + [(32, 1, "greedy batch 32")] * args.batch32
    for batch, beam, what in cases:
        rounds = [{name: profiled(m, batch, beam) for name, m in layouts.items()} for _ in range(args.rounds)]
        rows = {
            name: {b: statistics.median(r[name][b] for r in rounds) for b in (*BUCKETS, "step")} for name in layouts
        }
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
