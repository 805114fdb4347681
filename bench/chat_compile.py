"""Does ``torch.compile`` pay for a batch-1 chat step on the CPU? (issue 46, lever 2)

A one-row decoding step of a decoder-only RoPE model (SmolLM2-135M-Instruct, the qkv model
directory ``bench/chat_speed.py`` imports), written with static shapes so that one compiled graph
serves every step: a KV cache preallocated for ``--capacity`` positions and written in place at
the step's position (``index_copy_``), a boolean key mask over the whole cache, RoPE's rows read
from tables made once. The same function runs eager and compiled (inductor's CPU C++ backend), in
one process, alternating; it prints the compile time (CPU and wall: the first call) and each
side's CPU time per step, and qkv's own greedy step (``qkv.decoding.greedy`` on ``qkv.load``'s
float32 copy) for scale. The step's tokens are checked equal between eager and compiled.

This is a measurement, not a decoding path of qkv: the function reads the modules of
``qkv.load``'s float32 copy (stacked Q/K/V, stacked W1/W3, widening weights transposed) and
covers that one architecture (pre-norm, RoPE without scaling, no sliding window, no qk_norm).

    python bench/chat_compile.py --model-dir /tmp/qkv-smollm2 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "qkv-smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--capacity", type=int, default=512, help="positions the static KV cache holds")
    parser.add_argument("--prompt", type=int, default=200, help="positions taken as already cached")
    parser.add_argument("--steps", type=int, default=32, help="steps per timed run")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed runs per side (medians)")
    args = parser.parse_args()
    if not (args.model_dir / "config.json").is_file():
        raise SystemExit(f"chat_compile.py: no model in {args.model_dir}; run bench/chat_speed.py once to import it")
    if args.prompt + args.steps * (2 * args.rounds + 2) > args.capacity:
        raise SystemExit("chat_compile.py: --capacity must hold --prompt + --steps * (2 * --rounds + 2) positions")

    import torch
    import torch.nn.functional as F

    import qkv
    from qkv.decoding import greedy
    from qkv.positions import rope_turn

    torch.set_num_threads(args.threads)
    model = qkv.load(args.model_dir).model
    c = model.config
    g, h, k, cap = c.n_kv_heads or c.n_heads, c.n_heads, c.head_width, args.capacity
    blocks = list(model.decoder.blocks)
    cos, sin = (
        t.reshape(cap, k)
        for t in rope_turn(torch.arange(cap), width=k, dtype=torch.float32, device="cpu", base=c.rope_base)
    )  # (capacity, K) each

    def step(token, position, mask, keys, values):
        """One token (1, 1) at ``position`` (1,): logits (1, V); writes the caches (1, G, capacity, K) in place."""
        x = model.embed.token(token)  # (1, 1, D)
        turn_cos, turn_sin = cos[position].view(1, 1, 1, k), sin[position].view(1, 1, 1, k)  # (1, 1, 1, K) each
        for i, block in enumerate(blocks):
            attn = block.self_attn
            qkv_heads = attn.w_qkv(block.norm_1(x)).view(1, 1, h + 2 * g, k).transpose(1, 2)  # (1, H + 2G, 1, K)
            qk, v = qkv_heads.split([h + g, g], dim=1)  # (1, H + G, 1, K), (1, G, 1, K)
            qk = torch.addcmul(qk * turn_cos, qk.roll(k // 2, dims=-1), turn_sin)  # (1, H + G, 1, K): RoPE
            q, new_k = qk.split([h, g], dim=1)  # (1, H, 1, K), (1, G, 1, K)
            keys[i].index_copy_(2, position, new_k)  # (1, G, capacity, K) written in place
            values[i].index_copy_(2, position, v)  # (1, G, capacity, K) written in place
            out = F.scaled_dot_product_attention(
                q, keys[i], values[i], attn_mask=mask, enable_gqa=g != h
            )  # (1, H, 1, K)
            x = x + attn.w_o(out.transpose(1, 2).reshape(1, 1, h * k))  # (1, 1, D)
            x = x + block.ffn(block.norm_3(x))  # (1, 1, D)
        return model.output(model.decoder.norm(x))[:, -1]  # (1, V)

    keys = [torch.zeros(1, g, cap, k) for _ in blocks]  # the prompt's positions: any keys do for timing
    values = [torch.zeros(1, g, cap, k) for _ in blocks]
    mask = torch.zeros(1, 1, 1, cap, dtype=torch.bool)  # (1, 1, 1, capacity)
    mask[..., : args.prompt] = True
    filled = [args.prompt]

    def run(fn, steps: int) -> tuple[float, list[int]]:
        """CPU ms per step of ``steps`` greedy steps after the filled positions, and their tokens."""
        token, tokens = torch.tensor([[5]]), []
        start = time.process_time()
        for p in range(filled[0], filled[0] + steps):
            mask[..., p] = True
            token = fn(token, torch.tensor([p]), mask, keys, values).argmax(-1, keepdim=True)  # (1, 1)
            tokens.append(int(token))
        filled[0] += steps
        return (time.process_time() - start) / steps * 1e3, tokens

    with torch.no_grad():
        compiled = torch.compile(step, dynamic=False, fullgraph=True)
        run(step, 2)
        wall, cpu = time.perf_counter(), time.process_time()
        run(compiled, 1)
        print(f"compile (first call): {time.process_time() - cpu:.1f} s CPU, {time.perf_counter() - wall:.1f} s wall")
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            for name, fn in (("eager", step), ("compiled", compiled)):
                ms, _ = run(fn, args.steps)
                times[name].append(ms)
        saved = [(keys[i].clone(), values[i].clone()) for i in range(len(blocks))]
        at = filled[0]
        _, eager_tokens = run(step, 8)
        for i, (kk, vv) in enumerate(saved):
            keys[i].copy_(kk), values[i].copy_(vv)
        filled[0] = at
        mask[..., at:] = False
        _, compiled_tokens = run(compiled, 8)
        prompt = [list(range(100, 100 + args.prompt))]
        greedy(model, prompt, max_new_tokens=2)
        start = time.process_time()
        greedy(model, prompt, max_new_tokens=1)
        one = time.process_time() - start
        start = time.process_time()
        greedy(model, prompt, max_new_tokens=1 + args.steps)
        qkv_ms = (time.process_time() - start - one) / args.steps * 1e3
    for name, ms in times.items():
        print(f"{name} static step: {statistics.median(ms):.2f} ms CPU (median of {args.rounds}: {ms})")
    print(f"qkv greedy step (float32 copy): {qkv_ms:.2f} ms CPU")
    print(f"the same 8 tokens eager and compiled: {eager_tokens == compiled_tokens}")


if __name__ == "__main__":
    main()
