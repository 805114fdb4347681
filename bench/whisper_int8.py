"""Does ``--int8`` keep Whisper's words, and is it faster? Greedy transcripts of FSDD test files
by an imported Whisper in float32, in qkv's int8 (weight-only, per-channel; the vocabulary
projection in bfloat16) and in PyTorch's dynamic quantization (what ``--int8`` was before):
agreement with float32 and wall time, batch 1, one run, in one process.

    bash bench/fetch_whisper_tiny.sh && qkv import-hf /tmp/whisper-tiny.en /tmp/wt
    python bench/whisper_int8.py --model /tmp/wt --limit 50 --threads 1

Prints one line per mode; records nothing (figures go to docs/speed.md by hand, with the load).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def dynamic(bundle):
    """The bundle with PyTorch's dynamic int8 quantization of every nn.Linear (per-channel weights,
    activations quantized per tensor on the fly): the earlier ``--int8``."""
    from torch import nn
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = quantize_dynamic(copy.deepcopy(bundle.model), {nn.Linear: per_channel_dynamic_qconfig})
    return dataclasses.replace(bundle, model=model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="an imported Whisper (qkv import-hf)")
    parser.add_argument("--data", type=Path, default=Path("/work/shared/data/fsdd"), help="FSDD folder")
    parser.add_argument("--limit", type=int, default=50, help="the first N test files")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    import qkv
    from qkv.speech_corpora import fsdd_digits

    torch.set_num_threads(args.threads)
    files = [u.path for u in fsdd_digits(args.data)["test"][: args.limit]]
    modes = {
        "fp32": lambda: qkv.load(args.model),
        "int8": lambda: qkv.load(args.model, int8=True),
        "dynamic int8 (before)": lambda: dynamic(qkv.load(args.model)),
    }
    reference = None
    for name, make in modes.items():
        bundle = make()
        bundle.transcribe(files[:1], beam_size=1)  # warm-up
        start = time.perf_counter()
        texts = [bundle.transcribe(f, beam_size=1) for f in files]  # batch 1
        seconds = time.perf_counter() - start
        reference = texts if reference is None else reference
        same = sum(a == b for a, b in zip(reference, texts, strict=True))
        print(f"{name}: {seconds:.1f} s for {len(files)} files (batch 1), same as fp32 on {same}/{len(files)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
