"""Translation speed, side by side (issue 3, section 7; issue 49): qkv vs Hugging Face Marian,
torch.nn.Transformer (training) and CTranslate2 (decoding) on the same synthetic batches, in one run.

    python bench/mt_speed.py                 # both sizes, training and decoding (3 processes per decoding engine)
    python bench/mt_speed.py --sizes base --only decode --repeats 5 --notes "quiet machine"
    python bench/mt_speed.py --sizes tiny --only decode --repeats 2 --engines 'qkv fp32' 'HF fp32' --no-record

Training: target tokens/s of forward + backward + AdamW step (fused AdamW for all three, the
same label-smoothed loss, dropout 0.1), fp32 and bf16 autocast, for the base size (d=512, 8
heads, FFN 2048, 6+6 layers, vocab 8,000) and the small one (d=256, 4 heads, FFN 1024, 3+3).
qkv computes the loss through its own training path (``training.seq2seq_loss``), which skips
the output layer at padding positions: the same loss and gradients, tested equal.
``torch.nn.Transformer`` gets token embeddings, sinusoidal positions and an output layer. The
three train one after another in this process.
Decoding: new tokens/s with exactly 32 new tokens per input (END disabled on every side:
Hugging Face ``min_new_tokens=32``; qkv's END id is unset; CTranslate2 ``min_decoding_length``),
greedy at batch 1 and 32, beam 5 at batch 8, KV cache on every side: qkv as ``qkv translate``
decodes it (fp32, ``--bf16``, ``--int8``), HF Marian (fp32, bfloat16 weights, the same int8
linear layers: ``decoding_copies.int8_linears``) and CTranslate2 (fp32 and int8, the same random
Marian weights through its Transformers converter), and qkv's own model exported to ONNX
(``qkv.onnx_export``, fp32 and its int8 copy) decoded greedily through onnxruntime
(``qkv.onnx_runtime.OnnxModel``: the encoder once, a decoder step per token with its KV cache, a
numpy loop; greedy rows only, as many threads as torch). Every engine and precision is timed in a
process of its own (issue 49: CTranslate2's thread pool keeps the cores busy after its calls
return, which halved qkv's speed measured after it in one process), and in ``--repeats`` processes
(3 by default), interleaved across engines (A B C A B C ...): one process was not enough: HF fp32
at batch 32, the same transformers on the same machine, read 664.7 and 863.2 tokens/s in two quiet
runs. Each cell is the median of its processes, printed and recorded with their min-max; ratios
are of medians. Beside every batch-1 figure, the roofline the machine allows: the memory bandwidth
of a matrix-vector product over an fp32 matrix the size of the weights a step reads (decoder
layers and output layer), measured in this run before every round of processes (the median), over
those weights' bytes in the row's precision.

Extra packages (not in qkv's extras): ``transformers`` (dev extra) and ``ctranslate2`` (``pip
install ctranslate2``; without it its rows fail, said in one line, and the others run);
``onnx``, ``onnxruntime``, ``onnxscript`` (qkv's onnx extra) for the onnxruntime rows.
The third line above is a smoke run (tiny random model, two engines twice: about a minute).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from qkv.decoding import beam_search, greedy  # noqa: E402
from qkv.decoding_copies import int8_linears  # noqa: E402
from qkv.loading import prepared  # noqa: E402
from qkv.losses import seq2seq_loss  # noqa: E402
from qkv.memory import choose_allocator  # noqa: E402
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig  # noqa: E402
from qkv.training import Trainer  # noqa: E402

SIZES = {
    "base": {"d_model": 512, "n_heads": 8, "d_ff": 2048, "layers": 6},
    "small": {"d_model": 256, "n_heads": 4, "d_ff": 1024, "layers": 3},
    "tiny": {"d_model": 32, "n_heads": 2, "d_ff": 64, "layers": 1},  # only to check the script runs
}
VOCAB, PAD, BOS, EOS = 8000, 0, 1, 2


def qkv_model(size: dict, *, dropout: float) -> EncoderDecoder:
    return EncoderDecoder(
        EncoderDecoderConfig(
            d_model=size["d_model"],
            n_heads=size["n_heads"],
            d_ff=size["d_ff"],
            n_encoder_layers=size["layers"],
            n_decoder_layers=size["layers"],
            src_vocab_size=VOCAB,
            tgt_vocab_size=VOCAB,
            share_embeddings=True,
            tie_output=True,
            dropout=dropout,
            max_len=256,
        )
    )


def marian_model(size: dict, *, dropout: float):
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=VOCAB,
        d_model=size["d_model"],
        encoder_layers=size["layers"],
        decoder_layers=size["layers"],
        encoder_attention_heads=size["n_heads"],
        decoder_attention_heads=size["n_heads"],
        encoder_ffn_dim=size["d_ff"],
        decoder_ffn_dim=size["d_ff"],
        activation_function="relu",
        dropout=dropout,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=256,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=BOS,
        forced_eos_token_id=None,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
    )
    return MarianMTModel(config)


class TorchTransformer(nn.Module):
    """torch.nn.Transformer (pre-norm, batch first) with embeddings, sinusoidal positions and
    a tied output layer: the same model as qkv's default, built from PyTorch's modules."""

    def __init__(self, size: dict, *, dropout: float) -> None:
        super().__init__()
        d = size["d_model"]
        self.embed = nn.Embedding(VOCAB, d, padding_idx=PAD)
        self.core = nn.Transformer(
            d_model=d,
            nhead=size["n_heads"],
            num_encoder_layers=size["layers"],
            num_decoder_layers=size["layers"],
            dim_feedforward=size["d_ff"],
            dropout=dropout,
            batch_first=True,
            norm_first=True,
        )
        self.out = nn.Linear(d, VOCAB, bias=False)
        self.out.weight = self.embed.weight
        position = torch.arange(256)[:, None]
        rate = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(256, d)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * rate), torch.cos(position * rate)
        self.register_buffer("pe", pe)
        self.scale = math.sqrt(d)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.embed(src) * self.scale + self.pe[: src.shape[1]]  # (B, S, D)
        y = self.embed(tgt) * self.scale + self.pe[: tgt.shape[1]]  # (B, T, D)
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        h = self.core(
            x,
            y,
            tgt_mask=causal,
            src_key_padding_mask=src == PAD,
            tgt_key_padding_mask=tgt == PAD,
            memory_key_padding_mask=src == PAD,
            tgt_is_causal=True,
        )
        return self.out(h)  # (B, T, V)


def batches(n: int, *, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Synthetic (src, decoder input, target) batches, lengths 16..32 with padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        s_len = torch.randint(16, 33, (batch,), generator=g)
        t_len = torch.randint(16, 33, (batch,), generator=g)
        src = torch.randint(4, VOCAB, (batch, int(s_len.max())), generator=g)
        tgt = torch.randint(4, VOCAB, (batch, int(t_len.max()) + 1), generator=g)
        src[torch.arange(src.shape[1]) >= s_len[:, None]] = PAD
        tgt[torch.arange(tgt.shape[1]) >= t_len[:, None] + 1] = PAD
        tgt[:, 0] = BOS
        out.append((src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()))
    return out


def train_rate(name: str, model: nn.Module, data: list, *, bf16: bool, warm: int = 2, device: str = "cpu") -> float:
    """Target tokens/s over the batches after ``warm`` warm-up steps (on ``device``)."""
    model = model.to(device)
    data = [tuple(t.to(device) for t in batch) for batch in data]
    trainer = Trainer(model, lr=1e-4, warmup=10, total_steps=100, bf16=bf16, clip=1.0)

    def loss_of(src, t_in, t_out):
        def run():
            if name == "qkv":  # qkv's own training loss: logits at real target tokens only (tested equal)
                return seq2seq_loss(model, src, t_in, t_out, pad_id=PAD, label_smoothing=0.1)
            if name == "marian":
                logits = model(input_ids=src, attention_mask=src != PAD, decoder_input_ids=t_in).logits
            else:
                logits = model(src, t_in)
            flat = logits.reshape(-1, logits.shape[-1]).float()  # (B*T, V)
            loss = F.cross_entropy(flat, t_out.reshape(-1), ignore_index=PAD, label_smoothing=0.1)
            return loss, int((t_out != PAD).sum())

        return run

    tokens, start = 0, 0.0
    for i, (src, t_in, t_out) in enumerate(data):
        if i == warm:
            start, tokens = time.perf_counter(), 0
        _, n = trainer.step([loss_of(src, t_in, t_out)])
        tokens += n
    return tokens / (time.perf_counter() - start)


@torch.no_grad()
def decode_rate(name: str, model: nn.Module, *, batch: int, beam: int, repeats: int) -> float:
    """New tokens/s for 32 forced new tokens per input (the best output counted)."""
    inputs = sources(batch, beam)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        if name == "marian":
            width = max(map(len, inputs))
            ids = torch.tensor([s + [PAD] * (width - len(s)) for s in inputs])  # (B, S)
            out = model.generate(
                input_ids=ids,
                attention_mask=ids != PAD,
                max_new_tokens=32,
                min_new_tokens=32,
                num_beams=beam,
                do_sample=False,
                early_stopping=False,
            )
            assert out.shape[1] - 1 == 32, out.shape  # decoder start + 32
        elif beam == 1:
            out = greedy(model, inputs, max_new_tokens=32)
            assert all(len(o) == 32 for o in out)
        else:
            out = beam_search(model, inputs, beam_size=beam, max_new_tokens=32)
            assert all(len(h[0].tokens) == 32 for h in out)
        times.append(time.perf_counter() - start)
    return batch * 32 / min(times[1:])  # the best of the repeats after one warm-up


# ---- decoding: every engine and precision timed in a process of its own (issue 49) --------------

ENGINES = (
    "qkv fp32",
    "qkv bf16",
    "qkv int8",
    "HF fp32",
    "HF bf16",
    "HF int8",
    "CTranslate2 fp32",
    "CTranslate2 int8",
    "onnxruntime fp32",
    "onnxruntime int8",
)
ROWS = ((1, 1), (32, 1), (8, 5))  # (batch, beam): greedy batch 1, greedy batch 32, beam 5 batch 8
BYTES = {"fp32": 4, "bf16": 2, "int8": 1}  # bytes per weight as each precision reads it


def sources(batch: int, beam: int) -> list[list[int]]:
    """The row's inputs, the same ids for every engine: 16..32 random tokens each."""
    g = torch.Generator().manual_seed(batch * 10 + beam)
    return [
        torch.randint(4, VOCAB, (int(torch.randint(16, 33, (1,), generator=g)),), generator=g).tolist()
        for _ in range(batch)
    ]


def decoding_model(engine: str, size: dict):
    """The engine's model at its precision: qkv's as ``qkv translate`` decodes (a decoding copy,
    ``--bf16``, ``--int8``), HF Marian's (``.to(bfloat16)``, the same int8 linears), or a
    CTranslate2 translator converted from the same random Marian weights."""
    family, precision = engine.split()
    torch.manual_seed(0)  # the same random weights in every process
    if family == "onnxruntime":
        return onnx_model(size, precision)
    if family == "qkv":
        model = qkv_model(size, dropout=0.0).eval()
        # Forced length: with no END id the search never stops early (qkv.decoding treats None as "no END").
        object.__setattr__(model.config, "eos_id", None)
        return prepared(model, "encoder_decoder", bf16=precision == "bf16", int8=precision == "int8")
    model = marian_model(size, dropout=0.0).eval()
    if family == "CTranslate2":
        return ctranslate2_translator(model, precision)
    if precision == "bf16":
        return model.to(torch.bfloat16)
    return int8_linears(model) if precision == "int8" else model


def ctranslate2_translator(marian, precision: str):
    """The Marian model through CTranslate2's Transformers converter (``compute_type`` fp32 or int8).

    Random weights have no tokenizer: the converter is given one that names the ids."""
    import tempfile

    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    class Names:  # what the Marian loader reads of a tokenizer
        eos_token, unk_token = f"t{EOS}", "t3"

        def get_vocab(self) -> dict[str, int]:  # the last id is Marian's <pad>, which the converter drops
            return {**{f"t{i}": i for i in range(VOCAB - 1)}, "<pad>": VOCAB - 1}

    class Converter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return Names()

    folder = Path(tempfile.mkdtemp(prefix="mt_speed-ct2-"))
    marian.save_pretrained(folder / "hf")
    Converter(str(folder / "hf")).convert(str(folder / "ct2"), force=True)
    return ctranslate2.Translator(
        str(folder / "ct2"),
        device="cpu",
        compute_type="int8" if precision == "int8" else "float32",
        inter_threads=1,
        intra_threads=torch.get_num_threads(),
    )


def onnx_model(size: dict, precision: str):
    """qkv's model (the same random weights, END unset so that 32 tokens are always made) exported
    as ``qkv export-onnx`` does (``--int8`` for int8), opened in onnxruntime with torch's threads."""
    import tempfile

    from qkv.onnx_export import Source, export_onnx
    from qkv.onnx_runtime import OnnxModel

    model = qkv_model(size, dropout=0.0).eval()
    object.__setattr__(model.config, "eos_id", None)  # the manifest's eos_id: None, never stops early
    folder = Path(tempfile.mkdtemp(prefix="mt_speed-onnx-"))
    export_onnx(
        Source(model, {"kind": "encoder_decoder", "files": []}, folder), folder / "onnx", int8=precision == "int8"
    )
    return OnnxModel(folder / "onnx", int8=precision == "int8", threads=torch.get_num_threads())


def onnx_rate(model, *, batch: int, repeats: int) -> float:
    """New tokens/s of greedy decoding through onnxruntime, 32 new tokens per input, as :func:`decode_rate`."""
    inputs = sources(batch, 1)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out = model.greedy(inputs, max_new_tokens=32)
        assert all(len(o) == 32 for o in out), [len(o) for o in out]
        times.append(time.perf_counter() - start)
    return batch * 32 / min(times[1:])


def ctranslate2_rate(translator, *, batch: int, beam: int, repeats: int) -> float:
    """New tokens/s of CTranslate2 for 32 forced new tokens per input, as :func:`decode_rate`."""
    tokens = [[f"t{i}" for i in ids] for ids in sources(batch, beam)]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        out = translator.translate_batch(
            tokens, beam_size=beam, max_batch_size=batch, min_decoding_length=32, max_decoding_length=32
        )
        assert all(len(r.hypotheses[0]) == 32 for r in out), [len(r.hypotheses[0]) for r in out]
        times.append(time.perf_counter() - start)
    return batch * 32 / min(times[1:])


def engine_rates(engine: str, size: dict) -> dict[str, float]:
    """This process's new tokens/s of ``engine`` for every row of :data:`ROWS`, keyed "BATCHxBEAM"."""
    model = decoding_model(engine, size)
    rates = {}
    for batch, beam in ROWS:
        tries = 3 if batch == 1 else 2  # within the process: the best of these after a warm-up
        if engine.startswith("onnxruntime"):
            if beam == 1:  # the runtime's loop is greedy: no beam rows
                rates[f"{batch}x{beam}"] = onnx_rate(model, batch=batch, repeats=tries)
        elif engine.startswith("CTranslate2"):
            rates[f"{batch}x{beam}"] = ctranslate2_rate(model, batch=batch, beam=beam, repeats=tries)
        else:
            name = "qkv" if engine.startswith("qkv") else "marian"
            rates[f"{batch}x{beam}"] = decode_rate(name, model, batch=batch, beam=beam, repeats=tries)
    return rates


def step_weights(size: dict) -> int:
    """Weights read per batch-1 decoding step: the decoder layers (self-attention, cross-attention
    and feed-forward projections) and the output layer; norms and biases left out (under 0.1%)."""
    d, ff = size["d_model"], size["d_ff"]
    return size["layers"] * (8 * d * d + 2 * d * ff) + VOCAB * d


def bandwidth(n_bytes: int, repeats: int = 20) -> float:
    """Memory bandwidth (bytes/s) this machine gives a matrix-vector product over an fp32 matrix of
    ``n_bytes``: what a batch-1 decoding step does, so its roofline is bandwidth / bytes per step."""
    matrix = torch.randn(max(n_bytes // 4 // 1024, 1), 1024)
    vector = torch.randn(1024)
    best = math.inf
    for _ in range(repeats + 1):
        start = time.perf_counter()
        torch.mv(matrix, vector)
        best = min(best, time.perf_counter() - start)
    return matrix.numel() * 4 / best


def engine_process(engine: str, size_name: str, args: argparse.Namespace) -> dict[str, float] | None:
    """:func:`engine_rates` in a child process (the trap of issue 49: an engine whose thread pool
    stays busy after its calls slows whatever runs next in the same process)."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rates.json"
        command = [sys.executable, __file__, "--decode-engine", engine, "--sizes", size_name, "--figures", str(out)]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"} if args.omp_passive else None
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.is_file():
            print(f"{engine}: failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}", flush=True)
            return None
        return json.loads(out.read_text())


def timed_processes(engines: list[str], size_name: str, args: argparse.Namespace) -> tuple[dict, list[float]]:
    """Every engine's rates in ``args.repeats`` processes of its own, interleaved (A B C A B C ...) so
    that a slow spell of the machine falls on every engine alike, and the memory bandwidth measured
    (in this process, while no child runs) before every round. An engine whose process fails is not
    started again (a missing package fails every time); the rounds it finished are kept.

    Returns ({engine: [rates of each process]}, [bytes/s of each round])."""
    runs: dict[str, list[dict[str, float]]] = {e: [] for e in engines}
    speeds, failed = [], set()
    for _ in range(args.repeats):
        speeds.append(bandwidth(step_weights(SIZES[size_name]) * 4))
        for engine in engines:
            rates = None if engine in failed else engine_process(engine, size_name, args)
            if rates is None:
                failed.add(engine)
                continue
            runs[engine].append(rates)
    return {e: r for e, r in runs.items() if r}, speeds


def spread(figures: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of one cell's figures, one per process, each rounded to 0.1."""
    return tuple(round(x, 1) for x in (statistics.median(figures), min(figures), max(figures)))


def decode_rows(size_name: str, args: argparse.Namespace) -> list[dict]:
    """The decoding rows of one size: every engine in its own processes, our figures beside the
    peers', the bandwidth roofline beside every batch-1 figure. A row holds each engine's median
    (and, under "spread", [min, max] and "processes", how many processes gave it)."""
    size = SIZES[size_name]
    n_weights = step_weights(size)
    engines = [e for e in ENGINES if e in args.engines]
    runs, speeds = timed_processes(engines, size_name, args)
    speed = statistics.median(speeds)
    roof = {p: speed / (n_weights * b) for p, b in BYTES.items()}
    print(
        f"decode {size_name}: {n_weights / 1e6:.1f} M weights per step; matrix-vector bandwidth "
        f"{speed / 1e9:.1f} GB/s (median of {len(speeds)}: {min(speeds) / 1e9:.1f}-{max(speeds) / 1e9:.1f}); "
        f"batch-1 roofline fp32 {roof['fp32']:.0f} / bf16 {roof['bf16']:.0f} / int8 {roof['int8']:.0f} tokens/s",
        flush=True,
    )
    rows = []
    for batch, beam in ROWS:
        key = f"{batch}x{beam}"
        row: dict = {"what": f"decode {size_name} {'greedy' if beam == 1 else f'beam {beam}'} batch {batch}"}
        row["spread"], row["processes"] = {}, {}
        for engine, rates in runs.items():
            if key in rates[0]:
                median, low, high = spread([r[key] for r in rates])
                row[engine], row["spread"][engine], row["processes"][engine] = median, [low, high], len(rates)
        if batch == 1:
            row["roofline"] = {p: round(r) for p, r in roof.items()}
            row["bandwidth GB/s"] = round(speed / 1e9, 1)
        # the keys _record reads (and the records before CTranslate2 joined had)
        row["qkv"], row["qkv_bf16"], row["qkv_int8"] = (row.get(f"qkv {p}") for p in BYTES)
        row["hf"], row["hf_bf16"], row["hf_int8"] = (row.get(f"HF {p}") for p in BYTES)
        rows.append(row)
        print_row(row, engines, roof if batch == 1 else None)
    return rows


def print_row(row: dict, engines: list[str], roof: dict[str, float] | None) -> None:
    """One decoding row as a table: each engine's median, [min-max] over its processes, the ratio
    of the medians to HF fp32's and, at batch 1, the share of the roofline."""
    hf = row.get("HF fp32")
    print(f"{row['what']}  new tok/s, median [min-max] over each engine's processes:", flush=True)
    for engine in engines:
        if engine not in row["spread"]:
            continue
        figure, (low, high), precision = row[engine], row["spread"][engine], engine.split()[1]
        line = f"  {engine:<18} {figure:8.1f} [{low:7.1f}-{high:7.1f}] x{row['processes'][engine]}"
        if hf:
            line += f"   {figure / hf:5.2f}x HF fp32"
        if roof:
            line += f"   roofline {roof[precision]:6.0f} ({figure / roof[precision]:4.0%})"
        print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=sorted(SIZES))
    parser.add_argument("--only", choices=["train", "decode"])
    parser.add_argument("--steps", type=int, default=6, help="training steps per measurement (2 warm-up)")
    parser.add_argument("--batch", type=int, default=64, help="sentences per training batch")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (bench/gpu.sh)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), help="decoding engines (default: all)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="decoding: time every engine in this many processes of its own, interleaved across engines "
        "(A B C A B C ...); each figure is their median, printed and recorded with its min-max (default 3)",
    )
    parser.add_argument("--omp-passive", action="store_true", help="decoding children get OMP_WAIT_POLICY=PASSIVE")
    parser.add_argument("--no-record", action="store_true", help="print only; append nothing to bench/results")
    parser.add_argument("--notes", default="", help="notes for the records (say when the machine was busy)")
    parser.add_argument("--decode-engine", help=argparse.SUPPRESS)  # internal: a child's one engine
    parser.add_argument("--figures", type=Path, help=argparse.SUPPRESS)  # internal: where the child writes
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give 1 or more processes per engine")
    torch.manual_seed(0)
    results = []
    # As the qkv commands do (memory.py); in this one process it applies to every model alike.
    malloc = choose_allocator()
    if args.decode_engine:
        args.figures.write_text(json.dumps(engine_rates(args.decode_engine, SIZES[args.sizes[0]])))
        return 0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, allocator {malloc} for all models")
    for size_name in args.sizes:
        size = SIZES[size_name]
        if args.only != "decode":
            data = batches(args.steps, batch=args.batch, seed=0)
            for bf16 in (False, True):
                rates = {}
                for name, build in (("qkv", qkv_model), ("marian", marian_model), ("nn.Transformer", TorchTransformer)):
                    rates[name] = train_rate(name, build(size, dropout=0.1), data, bf16=bf16, device=args.device)
                peer = max(rates["marian"], rates["nn.Transformer"])
                row = {
                    "what": f"train {size_name} {'bf16' if bf16 else 'fp32'}"
                    + ("" if args.device == "cpu" else f" {args.device}"),
                    **{k: round(v) for k, v in rates.items()},
                    "ratio_vs_faster_peer": round(rates["qkv"] / peer, 2),
                }
                results.append(row)
                print(
                    f"{row['what']:<22} target tok/s: qkv {rates['qkv']:7.0f} | HF Marian {rates['marian']:7.0f} | "
                    f"nn.Transformer {rates['nn.Transformer']:7.0f} | qkv / faster peer {row['ratio_vs_faster_peer']}x",
                    flush=True,
                )
        if args.only != "train":
            results += decode_rows(size_name, args)
    print(json.dumps(results))
    if not args.no_record:
        _record(results, notes=args.notes)
    return 0


def _record(results: list[dict], *, notes: str = "") -> None:
    """Append this run's figures to bench/results/mt_speed.json (docs/results.md is rendered from it).

    A decoding record's details hold the peers at its precision (HF, CTranslate2) and, at batch 1,
    the roofline the measured bandwidth allows and the share of it reached."""
    from record import append_run  # bench/record.py, beside this script

    records = []
    for row in results:
        words = row["what"].split()  # "train small bf16" | "decode base greedy batch 1"
        if words[0] == "train":
            peers = {"HF Marian": row["marian"], "nn.Transformer": row["nn.Transformer"]}
            records.append(
                {
                    "metric": row["what"] if len(words) == 3 else f"{' '.join(words[:3])} on {words[3]}",
                    "figure": row["qkv"],
                    "unit": "target tokens/s",
                    "peer": "the faster of HF Marian and nn.Transformer",
                    "peer_figure": max(peers.values()),
                    "target": {"min_ratio": 1.3} if words[2] == "bf16" and len(words) == 3 else None,  # issue 3's goal
                    "details": peers,
                }
            )
            continue
        size, search = words[1], " ".join(words[2:])
        for precision, ours in (("fp32", "qkv"), ("bf16", "qkv_bf16"), ("int8", "qkv_int8")):
            if row[ours] is None:  # not measured in this run
                continue
            details = {} if precision == "fp32" else {f"HF {precision}": row[f"hf_{precision}"]}
            for peer in ("CTranslate2", "onnxruntime"):
                if row.get(f"{peer} {precision}") is not None:
                    details[f"{peer} {precision}"] = row[f"{peer} {precision}"]
            details |= _spreads(row, [f"qkv {precision}", "HF fp32", *details])
            if "roofline" in row:
                roof = row["roofline"][precision]
                details |= {"roofline tokens/s": roof, "share of the roofline, %": round(100 * row[ours] / roof)}
                details["bandwidth GB/s"] = row["bandwidth GB/s"]
            records.append(
                {
                    "metric": f"decode {size} {precision} {search}",
                    "figure": row[ours],
                    "unit": "new tokens/s",
                    "peer": "HF generate fp32",
                    "peer_figure": row["hf"],
                    "target": {"min_ratio": 2},  # issue 3's goal, against HF's fp32 generate
                    "details": details,
                    "notes": notes,
                }
            )
    append_run("mt_speed", records)


def _spreads(row: dict, engines: list[str]) -> dict:
    """A record's detail of how its figures (medians) varied: how many processes gave ours, and
    [min, max] of ours ("min-max") and of each peer's in ``engines`` that the row measured so."""
    spreads, ours = row.get("spread", {}), engines[0]
    if ours not in spreads:  # a row from before --repeats (one process each)
        return {}
    out = {"processes": row["processes"][ours], "min-max": spreads[ours]}
    return out | {f"{e} min-max": spreads[e] for e in engines[1:] if e in spreads}


if __name__ == "__main__":
    sys.exit(main())
