"""Where a Piper voice's synthesis goes in qkv (issue 45): per part of the model, the wall time,
the CPU time of all threads and the CPU time of the calling thread, each per second of speech.

    python bench/piper_profile.py                     # the joe voice from /tmp/piper-joe, 50 captions
    python bench/piper_profile.py --threads 2 --sentences 20

The parts: the text encoder (``enc_p``), the duration predictor (``dp``), the flow
(``flow.inverse``), the generator (``dec``) and the rest (alignment, the prior's sample, Python).
The calling thread's CPU time is what no other thread could take over: with the work of a
parallel operation split evenly, it is the wall time the part would take on idle cores, so it
stays readable on a machine shared with other jobs, where the wall time also counts the waits for
a core. All threads' minus twice the calling thread's (on 2 threads) is how far from an even split
a part is. Sentences and scales as ``bench/piper_speed.py``'s (the first ``--sentences`` English
captions of Multi30k's test2016, the voice's scales, one warm-up sentence), on the allocator the
qkv commands choose and ``OMP_WAIT_POLICY=PASSIVE`` unless set. Prints only; records nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

PARTS = ("enc_p", "dp", "flow", "dec")


def clocks() -> tuple[float, float, float]:
    """Wall, all threads' CPU and this thread's CPU seconds."""
    return time.perf_counter(), time.process_time(), time.thread_time()


def timed_parts(model) -> dict[str, list[float]]:
    """Each part's (wall, CPU, this thread's CPU) seconds, summed over the calls from now on."""
    totals = {part: [0.0, 0.0, 0.0] for part in PARTS}
    started: dict[str, tuple[float, float, float]] = {}

    def start(part: str) -> None:
        started[part] = clocks()

    def stop(part: str) -> None:
        totals[part] = [t + (now - then) for t, now, then in zip(totals[part], clocks(), started[part], strict=True)]

    for part in ("enc_p", "dp", "dec"):
        module = getattr(model, part)
        module.register_forward_pre_hook(lambda _m, _a, part=part: start(part))
        module.register_forward_hook(lambda _m, _a, _o, part=part: stop(part))
    inverse = model.flow.inverse

    def flow_inverse(*args, **kwargs):  # the flow runs backwards, through no forward hook
        start("flow")
        z = inverse(*args, **kwargs)
        stop("flow")
        return z

    model.flow.inverse = flow_inverse
    return totals


def main() -> None:
    import piper_speed

    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="example: python bench/piper_profile.py --sentences 20"
    )
    p.add_argument("--voice", type=Path, default=piper_speed.VOICE)
    p.add_argument("--sentences", type=int, default=50, help="the first N test2016 captions (default 50)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when OpenMP starts, after this
    from qkv.memory import choose_allocator

    choose_allocator()  # as the qkv commands do (it may restart the process)
    import torch

    from qkv.hf.piper import read_voice
    from qkv.piper import Voice, phoneme_ids, phonemize

    torch.set_num_threads(args.threads)
    config = json.loads(args.voice.with_name(args.voice.name + ".json").read_text(encoding="utf-8"))
    voice = Voice(espeak_voice=config["espeak"]["voice"], id_map=config["phoneme_id_map"])
    texts = piper_speed.captions(args.sentences)
    ids = [phoneme_ids(s, voice.id_map) for text in texts for s in phonemize(text, voice.espeak_voice)]
    model, _, _ = read_voice(args.voice)
    g = torch.Generator().manual_seed(0)

    def speak(sentence: list[int]) -> int:
        return int(model(torch.tensor([sentence]), torch.tensor([len(sentence)]), generator=g).lengths[0])

    speak(ids[0])  # warm-up, as piper_speed's
    parts = timed_parts(model)
    begin = clocks()
    speech = sum(speak(sentence) for sentence in ids) / model.config.sample_rate
    whole = [now - then for now, then in zip(clocks(), begin, strict=True)]
    rest = [w - sum(parts[part][i] for part in PARTS) for i, w in enumerate(whole)]
    print(f"{len(ids)} sentences, {speech:.1f} s of speech, {args.threads} threads; ms per second of speech:")
    print(f"{'part':8s} {'wall':>8s} {'CPU':>8s} {'thread':>8s}")
    for name, (wall, cpu, thread) in [*parts.items(), ("rest", rest), ("all", whole)]:
        print(f"{name:8s} {wall / speech * 1e3:8.2f} {cpu / speech * 1e3:8.2f} {thread / speech * 1e3:8.2f}")
    print(f"(load average over the last minute: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
