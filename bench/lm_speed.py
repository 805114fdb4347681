"""GPT and BERT speed, side by side (issue 4, section 5): qkv vs Hugging Face GPT2LMHeadModel
and BertModel on the same synthetic batches, in one run.

    python bench/lm_speed.py                # ~5 minutes on 2 cores
    python bench/lm_speed.py --only bert

Decoder-only, nanoGPT's Shakespeare size (6 layers, width 384, 6 heads, context 256,
vocabulary 65, batch 64): training tokens/s (forward + backward + fused AdamW step, dropout
0.2 as nanoGPT's recipe) in fp32 and bf16 autocast, and KV-cache generation tokens/s (one
prompt token, 255 new tokens, greedy, batch 1 and 16; END disabled on both sides), fp32 and
again with bfloat16 weights on both sides, and qkv with int8 linear layers (against HF fp32).
Encoder-only: inference sentences/s of the last hidden states, 4 layers, width 256, 4 heads,
batch 32 x 128 tokens (lengths 64..128 with padding masks), fp32 and bf16 autocast.
Both sides get the same architecture: GPT-2's (pre-norm, learned positions, tanh GELU, biases)
and BERT's (post-norm, learned positions, token types, embedding LayerNorm, exact GELU).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from qkv.decoding import greedy  # noqa: E402
from qkv.decoding_copies import for_decoding, int8_linears  # noqa: E402
from qkv.memory import choose_allocator  # noqa: E402
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig  # noqa: E402
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig  # noqa: E402
from qkv.training import Trainer  # noqa: E402

GPT = {"d_model": 384, "n_heads": 6, "n_layers": 6, "max_len": 256, "vocab": 65, "batch": 64}
BERT = {"d_model": 256, "n_heads": 4, "n_layers": 4, "vocab": 8000, "batch": 32, "length": 128}


def qkv_gpt(dropout: float) -> DecoderOnly:
    return DecoderOnly(
        DecoderOnlyConfig(
            vocab_size=GPT["vocab"],
            d_model=GPT["d_model"],
            n_heads=GPT["n_heads"],
            d_ff=4 * GPT["d_model"],
            n_layers=GPT["n_layers"],
            max_len=GPT["max_len"],
            dropout=dropout,
            positions="learned",
            activation="gelu_tanh",
            scale_embeddings=False,
            tie_output=True,
        )
    )


def hf_gpt(dropout: float):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=GPT["vocab"],
        n_positions=GPT["max_len"],
        n_embd=GPT["d_model"],
        n_layer=GPT["n_layers"],
        n_head=GPT["n_heads"],
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def train_rate(name: str, model, *, bf16: bool, steps: int, device: str = "cpu") -> float:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, GPT["vocab"], (steps, GPT["batch"], GPT["max_len"] + 1), generator=g).to(device)
    model = model.to(device)
    trainer = Trainer(model, lr=1e-4, warmup=10, total_steps=100, bf16=bf16, weight_decay=0.1)

    def batch(x, y):
        def run():
            logits = model(input_ids=x).logits if name == "hf" else model(x)  # (B, T, V)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)), y.numel()

        return run

    start, tokens = 0.0, 0
    for i in range(steps):
        if i == 2:  # two warm-up steps
            start, tokens = time.perf_counter(), 0
        _, n = trainer.step([batch(data[i, :, :-1], data[i, :, 1:])])
        tokens += n
    return tokens / (time.perf_counter() - start)


@torch.no_grad()
def generate_rate(name: str, model, *, batch: int, new: int) -> float:
    prompts = torch.randint(0, GPT["vocab"], (batch, 1), generator=torch.Generator().manual_seed(batch))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        if name == "hf":
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
                use_cache=True,
            )
            assert out.shape[1] == 1 + new
        else:
            out = greedy(model, prompts.tolist(), max_new_tokens=new)
            assert all(len(o) == new for o in out)
        times.append(time.perf_counter() - start)
    return batch * new / min(times)


def bert_models():
    from transformers import BertConfig, BertModel

    theirs = BertModel(
        BertConfig(
            vocab_size=BERT["vocab"],
            hidden_size=BERT["d_model"],
            num_hidden_layers=BERT["n_layers"],
            num_attention_heads=BERT["n_heads"],
            intermediate_size=4 * BERT["d_model"],
            max_position_embeddings=512,
        ),
        add_pooling_layer=False,
    ).eval()
    ours = EncoderOnly(
        EncoderOnlyConfig(
            vocab_size=BERT["vocab"],
            d_model=BERT["d_model"],
            n_heads=BERT["n_heads"],
            d_ff=4 * BERT["d_model"],
            n_layers=BERT["n_layers"],
            max_len=512,
            dropout=0.0,
            positions="learned",
            activation="gelu",
            norm_first=False,
            norm_eps=1e-12,
            type_vocab_size=2,
            embedding_norm=True,
            scale_embeddings=False,
            mlm_head=False,
        )
    ).eval()
    return ours, theirs


@torch.no_grad()
def bert_rate(name: str, model, *, bf16: bool, repeats: int = 5) -> float:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, BERT["vocab"], (BERT["batch"], BERT["length"]), generator=g)
    lengths = torch.randint(BERT["length"] // 2, BERT["length"] + 1, (BERT["batch"],), generator=g)
    mask = torch.arange(BERT["length"]) < lengths[:, None]  # (B, S): True = a real token
    ids = ids.masked_fill(~mask, 0)
    types = torch.zeros_like(ids)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if name == "hf":
                hidden = model(input_ids=ids, attention_mask=mask.long(), token_type_ids=types).last_hidden_state
            else:
                hidden = model.encode(ids, mask=mask, token_types=types)
        assert hidden.shape == (BERT["batch"], BERT["length"], BERT["d_model"])
        times.append(time.perf_counter() - start)
    return BERT["batch"] / min(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["train", "generate", "bert"])
    parser.add_argument("--steps", type=int, default=5, help="training steps per measurement (2 warm-up)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine (bench/gpu.sh)")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    # As the qkv commands do (memory.py); in this one process it applies to every model alike.
    malloc = choose_allocator()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, allocator {malloc} for all models")

    def show(what: str, ours: float, theirs: float, unit: str, peer: str) -> None:
        results.append({"what": what, "qkv": round(ours, 1), "hf": round(theirs, 1), "ratio": round(ours / theirs, 2)})
        print(f"{what:<36} {unit}: qkv {ours:9.1f} | {peer} {theirs:9.1f} | ratio {ours / theirs:.2f}x", flush=True)

    if args.only in (None, "train"):
        for bf16 in (False, True):
            a = train_rate("qkv", qkv_gpt(0.2), bf16=bf16, steps=args.steps, device=args.device)
            b = train_rate("hf", hf_gpt(0.2), bf16=bf16, steps=args.steps, device=args.device)
            on = "" if args.device == "cpu" else f" on {args.device}"
            show(f"GPT train {'bf16' if bf16 else 'fp32'} (B64 x T256){on}", a, b, "tokens/s", "HF GPT2LMHeadModel")
    if args.only in (None, "generate"):
        # As qkv generate decodes: a decoding copy with one stacked Q/K/V product per self-attention.
        ours, theirs = for_decoding(qkv_gpt(0.0).eval()), hf_gpt(0.0).eval()
        # And both with bfloat16 weights (qkv generate --bf16; HF: .to(torch.bfloat16)).
        ours_bf16, theirs_bf16 = copy.deepcopy(ours).to(torch.bfloat16), copy.deepcopy(theirs).to(torch.bfloat16)
        # qkv with int8 linear layers (qkv generate --int8). Not applied to HF: GPT-2's projections
        # are Conv1D modules, which PyTorch's dynamic quantization leaves in fp32.
        ours_int8 = int8_linears(ours)
        for batch in (1, 16):
            new = GPT["max_len"] - 1
            a = generate_rate("qkv", ours, batch=batch, new=new)
            b = generate_rate("hf", theirs, batch=batch, new=new)
            show(f"GPT generate fp32 batch {batch} ({new} new)", a, b, "tokens/s", "HF generate")
            a16 = generate_rate("qkv", ours_bf16, batch=batch, new=new)
            b16 = generate_rate("hf", theirs_bf16, batch=batch, new=new)
            show(f"GPT generate bf16 weights batch {batch}", a16, b16, "tokens/s", "HF bf16 ")
            show(f"GPT generate qkv bf16 / HF fp32 batch {batch}", a16, b, "tokens/s", "HF fp32 ")
            a8 = generate_rate("qkv", ours_int8, batch=batch, new=new)
            show(f"GPT generate qkv int8 / HF fp32 batch {batch}", a8, b, "tokens/s", "HF fp32 ")
    if args.only in (None, "bert"):
        ours, theirs = bert_models()
        for bf16 in (False, True):
            a, b = bert_rate("qkv", ours, bf16=bf16), bert_rate("hf", theirs, bf16=bf16)
            show(f"BERT encode {'bf16' if bf16 else 'fp32'} (32 x 128)", a, b, "sentences/s", "HF BertModel")
    print(json.dumps(results))
    _record(results)
    return 0


def _record(results: list[dict]) -> None:
    """Append this run's figures to bench/results/lm_speed.json (docs/results.md is rendered from it)."""
    from record import append_run  # bench/record.py, beside this script

    records, hf_bf16 = [], {}
    for row in results:
        words = row["what"].split()
        if words[:2] == ["GPT", "train"]:  # "GPT train fp32 (B64 x T256)"
            on = " ".join(words[-2:]) if words[-2] == "on" else ""  # "... on cuda": a GPU run, no CPU target
            metric = f"GPT train {words[2]} (B64 × T256){' ' + on if on else ''}"
            unit, peer, target = "tokens/s", "HF GPT2LMHeadModel", None if on else 1.5
        elif words[:2] == ["BERT", "encode"]:  # "BERT encode fp32 (32 x 128)"
            metric, unit, peer, target = f"BERT encode {words[2]} (32 × 128)", "sentences/s", "HF BertModel", None
        elif words[2:4] == ["bf16", "weights"]:  # "GPT generate bf16 weights batch 1": both in bf16
            hf_bf16[words[-1]] = row["hf"]
            continue
        else:  # "GPT generate fp32 batch 1 (255 new)", "GPT generate qkv int8 / HF fp32 batch 1"
            precision = words[2] if words[2] != "qkv" else words[3]
            batch = words[words.index("batch") + 1]
            metric, unit, peer, target = f"GPT generate {precision} batch {batch}", "tokens/s", "HF generate fp32", 2
        record = {
            "metric": metric,
            "figure": row["qkv"],
            "unit": unit,
            "peer": peer,
            "peer_figure": row["hf"],
            "target": None if target is None else {"min_ratio": target},  # issue 4's goals
        }
        if metric.startswith("GPT generate bf16"):
            record["details"] = {"HF bf16": hf_bf16[metric.split()[-1]]}
        records.append(record)
    append_run("lm_speed", records)


if __name__ == "__main__":
    sys.exit(main())
