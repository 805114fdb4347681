"""Translation speed, side by side (issue 3, section 7): qkv vs Hugging Face Marian and
torch.nn.Transformer on the same synthetic batches, in one run.

    python bench/mt_speed.py                 # both sizes, training and decoding (~15 min)
    python bench/mt_speed.py --sizes small --only train

Training: target tokens/s of forward + backward + AdamW step (fused AdamW for all three, the
same label-smoothed loss, dropout 0.1), fp32 and bf16 autocast, for the base size (d=512, 8
heads, FFN 2048, 6+6 layers, vocab 8,000) and the small one (d=256, 4 heads, FFN 1024, 3+3).
qkv computes the loss through its own training path (``training.seq2seq_loss``), which skips
the output layer at padding positions: the same loss and gradients, tested equal.
``torch.nn.Transformer`` gets token embeddings, sinusoidal positions and an output layer.
Decoding: new tokens/s with exactly 32 new tokens per input (END disabled on both sides:
Hugging Face ``min_new_tokens=32``; qkv's END id is unset), greedy at batch 1 and 32, beam 5
at batch 8, KV cache on both; fp32, both models again with bfloat16 weights, and both with
int8 linear layers (``decoding_copies.int8_linears``: PyTorch dynamic quantization). Reference
ceilings from issue 3 (not re-measured here): CTranslate2 int8 at the base size 192 / 2,174 /
532 tokens/s; Hugging Face fp32 78 / 960 / 218.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from qkv.decoding import beam_search, greedy  # noqa: E402
from qkv.decoding_copies import for_decoding, int8_linears  # noqa: E402
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
    g = torch.Generator().manual_seed(batch * 10 + beam)
    sources = [
        torch.randint(4, VOCAB, (int(torch.randint(16, 33, (1,), generator=g)),), generator=g).tolist()
        for _ in range(batch)
    ]
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        if name == "marian":
            width = max(map(len, sources))
            ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sources])  # (B, S)
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
            out = greedy(model, sources, max_new_tokens=32)
            assert all(len(o) == 32 for o in out)
        else:
            out = beam_search(model, sources, beam_size=beam, max_new_tokens=32)
            assert all(len(h[0].tokens) == 32 for h in out)
        times.append(time.perf_counter() - start)
    return batch * 32 / min(times[1:])  # the best of the repeats after one warm-up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["small", "base"], choices=sorted(SIZES))
    parser.add_argument("--only", choices=["train", "decode"])
    parser.add_argument("--steps", type=int, default=6, help="training steps per measurement (2 warm-up)")
    parser.add_argument("--batch", type=int, default=64, help="sentences per training batch")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (bench/gpu.sh)")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    # As the qkv commands do (memory.py); in this one process it applies to every model alike.
    malloc = choose_allocator()
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
            ours = qkv_model(size, dropout=0.0).eval()
            # Forced length: with no END id the search never stops early (qkv.decoding treats None as "no END").
            object.__setattr__(ours.config, "eos_id", None)
            # As qkv translate decodes: a decoding copy with one stacked Q/K/V product per self-attention.
            ours = for_decoding(ours)
            theirs = marian_model(size, dropout=0.0).eval()
            # The same models with bfloat16 weights (qkv translate --bf16; HF: .to(torch.bfloat16)).
            ours_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
            theirs_bf16 = copy.deepcopy(theirs).to(torch.bfloat16)
            # And with int8 linear layers (qkv translate --int8), the same quantization on both sides.
            ours_int8, theirs_int8 = int8_linears(ours), int8_linears(theirs)
            for batch, beam in ((1, 1), (32, 1), (8, 5)):
                repeats = 3 if batch == 1 else 2
                a = decode_rate("qkv", ours, batch=batch, beam=beam, repeats=repeats)
                b = decode_rate("marian", theirs, batch=batch, beam=beam, repeats=repeats)
                a16 = decode_rate("qkv", ours_bf16, batch=batch, beam=beam, repeats=repeats)
                b16 = decode_rate("marian", theirs_bf16, batch=batch, beam=beam, repeats=repeats)
                a8 = decode_rate("qkv", ours_int8, batch=batch, beam=beam, repeats=repeats)
                b8 = decode_rate("marian", theirs_int8, batch=batch, beam=beam, repeats=repeats)
                what = f"decode {size_name} {'greedy' if beam == 1 else f'beam {beam}'} batch {batch}"
                results.append(
                    {
                        "what": what,
                        "qkv": round(a),
                        "hf": round(b),
                        "ratio": round(a / b, 2),
                        "qkv_bf16": round(a16),
                        "hf_bf16": round(b16),
                        "ratio_bf16_vs_hf_fp32": round(a16 / b, 2),
                        "ratio_bf16_vs_hf_bf16": round(a16 / b16, 2),
                        "qkv_int8": round(a8),
                        "hf_int8": round(b8),
                        "ratio_int8_vs_hf_fp32": round(a8 / b, 2),
                        "ratio_int8_vs_hf_int8": round(a8 / b8, 2),
                    }
                )
                print(
                    f"{what:<32} new tok/s fp32: qkv {a:7.0f} | HF generate {b:7.0f} | ratio {a / b:.2f}x   "
                    f"bf16 weights: qkv {a16:7.0f} | HF {b16:7.0f} | qkv bf16 / HF fp32 {a16 / b:.2f}x, "
                    f"/ HF bf16 {a16 / b16:.2f}x   int8: qkv {a8:7.0f} | HF {b8:7.0f} | qkv int8 / HF fp32 "
                    f"{a8 / b:.2f}x, / HF int8 {a8 / b8:.2f}x",
                    flush=True,
                )
    print(json.dumps(results))
    _record(results)
    return 0


def _record(results: list[dict]) -> None:
    """Append this run's figures to bench/results/mt_speed.json (docs/results.md is rendered from it)."""
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
            records.append(
                {
                    "metric": f"decode {size} {precision} {search}",
                    "figure": row[ours],
                    "unit": "new tokens/s",
                    "peer": "HF generate fp32",
                    "peer_figure": row["hf"],
                    "target": {"min_ratio": 2},  # issue 3's goal, against HF's fp32 generate
                    "details": {} if precision == "fp32" else {f"HF {precision}": row[f"hf_{precision}"]},
                }
            )
    append_run("mt_speed", records)


if __name__ == "__main__":
    sys.exit(main())
