"""The int8 copy's vocabulary projection, two ways, side by side (issue 49): ``--int8``'s bfloat16
output layer packed once for oneDNN (:class:`qkv.layers.PackedLinear`, what ``decoding_copies.int8_linears``
gives where oneDNN runs bfloat16) against the same bfloat16 weight through ``F.linear``
(:class:`qkv.int8.Bf16Linear`, what it gave before). The rest of the model is the one int8 copy of
``bench/mt_speed.py``'s base encoder-decoder (d=512, 6+6 layers, vocabulary 8,000); only its
``output`` is swapped between runs.

Two measurements, the two ways alternating in this one process (A B B A, round after round, so
neither always runs first), each figure the median over the rounds, in CPU time (the process's, all
threads: a busy machine takes the CPU away from us, which stretches wall time but not CPU time) and
wall time:

    step    greedy decoding at batch 1, 32 new tokens (the encoder once, as mt_speed's row): ms a token
    layer   the output layer alone on one float32 row, 200 calls: microseconds a call

    python bench/vocab_ab.py                       # 1 and 2 threads, 9 rounds: a few minutes
    python bench/vocab_ab.py --threads 1 --rounds 3   # a quick look
    OMP_WAIT_POLICY=PASSIVE python bench/vocab_ab.py --threads 2 --rounds 21   # 2 threads on a busy machine

With 2 threads on a busy machine, OpenMP's waiting threads spin on the CPU while their partner
waits for a core: CPU time per step rose from about 8 to over 100 ms, more noise than signal;
``OMP_WAIT_POLICY=PASSIVE`` makes them sleep instead.

Prints only; nothing is recorded (a same-process A/B on a shared machine decides a layout, it is
not a speed figure: ``bench/mt_speed.py`` measures those).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mt_speed

from qkv.decoding import greedy
from qkv.int8 import Bf16Linear
from qkv.layers import PackedLinear, packable
from qkv.loading import prepared
from qkv.memory import choose_allocator

NEW = 32
CALLS = 200


def timed(run) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of one call of ``run``."""
    cpu, wall = time.process_time(), time.perf_counter()
    run()
    return time.process_time() - cpu, time.perf_counter() - wall


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=9, help="A B B A rounds; each figure is their median")
    args = parser.parse_args()
    if not packable():
        print("vocab_ab.py: this CPU or build has no oneDNN bfloat16 kernels: PackedLinear is not used here")
        return 2
    choose_allocator()
    torch.manual_seed(0)
    model = mt_speed.qkv_model(mt_speed.SIZES["base"], dropout=0.0).eval()
    object.__setattr__(model.config, "eos_id", None)  # exactly NEW tokens
    copy = prepared(model, "encoder_decoder", int8=True)
    ways = {"PackedLinear": PackedLinear(model.output), "Bf16Linear": Bf16Linear(model.output)}
    inputs = mt_speed.sources(1, 1)
    row = torch.randn(1, model.config.d_model)  # (1, D)

    def step(way: str) -> tuple[float, float]:
        copy.output = ways[way]
        return timed(lambda: greedy(copy, inputs, max_new_tokens=NEW))

    def layer(way: str) -> tuple[float, float]:
        return timed(lambda: [ways[way](row) for _ in range(CALLS)])

    tokens = {}
    for way in ways:
        copy.output = ways[way]
        tokens[way] = greedy(copy, inputs, max_new_tokens=NEW)  # also the warm-up
    print(f"same tokens both ways: {tokens['PackedLinear'] == tokens['Bf16Linear']}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, run, per, unit in (("step", step, NEW, "ms a token"), ("layer", layer, CALLS / 1e3, "us a call")):
            times = {way: [] for way in ways}
            for i in range(args.rounds):
                order = list(ways) if i % 2 == 0 else list(reversed(ways))
                for way in order:
                    times[way].append(run(way))
            for way, pairs in times.items():
                cpu = [c * 1e3 / per for c, _ in pairs]
                wall = [w * 1e3 / per for _, w in pairs]
                print(
                    f"{threads} thread(s) {name:5s} {way:12s} CPU {statistics.median(cpu):8.3f} "
                    f"(min {min(cpu):.3f})   wall {statistics.median(wall):8.3f} (min {min(wall):.3f})  {unit}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
