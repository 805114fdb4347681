"""Continuous batching on ``qkv serve`` (issue 46, section 3): N short chats through OpenAI's API
(or N continuations through ``/v1/generate``), one after another against all at once and against
arrivals spread over time.

    python bench/chat_batching.py --model /tmp/sb_smollm2               # 8 chats of 32 tokens
    python bench/chat_batching.py --model models/smollm2 --chats 16 --max-tokens 64 --threads 2
    python bench/chat_batching.py --model /tmp/sb_smollm2 --route generate --no-record   # /v1/generate

A fresh ``qkv serve --model DIR`` starts on a free port of 127.0.0.1 (``OMP_NUM_THREADS`` =
``--threads``) for each setting: batching on, and ``--no-batching`` (every request a batch of its
own, the batches taking turns a step each). Each chat is a short question of its own, greedy, its
answer streamed (``openai`` client; ``--whole``: not streamed) and ``--max-tokens`` long unless the
model ends it. With ``--route generate`` each question is continued by ``/v1/generate`` instead,
as the prompt "Q: question", a new line, "A: Let me explain." (an instruct model ends a bare
question at once); greedy, ``max_new_tokens`` = ``--max-tokens``, streamed as its Server-Sent
Events, or whole with ``--whole``; the same continuous batcher decodes it. Patterns:

  * ``sequential``: each chat sent when the one before has answered (the baseline);
  * ``together``: every chat sent at once;
  * ``staggered``: one chat sent every ``--gap`` seconds, so that most join a batch already decoding
    (what continuous batching is for: a fixed batch would make each wait for the one before).

Reported per pattern: the wall time until every answer has ended, generated tokens/s over it, the
mean time to the first piece of text and the mean time to the whole answer; and whether the answers
of each pattern equal the sequential ones (greedy: they must). A warm-up chat runs first.
Appends its figures to bench/results/chat_batching.json (bench/record.py); ``--no-record`` skips that.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from serving import serving  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Why is the sky blue?",
    "What is 12 times 7?",
    "Give me a word that rhymes with cat.",
    "What do bees make?",
    "Which planet is the largest?",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?",
    "What language is spoken in Brazil?",
    "What is the opposite of cold?",
    "How many days are in a leap year?",
    "What gas do plants take in?",
    "What is the tallest animal?",
    "Translate 'thank you' into German.",
]


async def chat(client, model: str, question: str, max_tokens: int, *, after: float = 0.0) -> dict:
    """One streamed greedy chat: its text, tokens, time to first piece and to the end (from its send)."""
    await asyncio.sleep(after)
    sent = time.perf_counter()
    first, text, tokens = None, "", 0
    chunks = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in chunks:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            first = first or time.perf_counter() - sent
            text += piece
    return {"text": text, "tokens": tokens, "first_s": first or float("nan"), "whole_s": time.perf_counter() - sent}


async def continuation(client, model: str, prompt: str, max_tokens: int, *, whole: bool, after: float = 0.0) -> dict:
    """One greedy ``/v1/generate`` of ``prompt`` (streamed unless ``whole``), measured as :func:`chat`."""
    import json

    await asyncio.sleep(after)
    sent = time.perf_counter()
    prompt = f"Q: {prompt}\nA: Let me explain."  # a bare question an instruct model ends at once
    body = {"model": model, "prompt": prompt, "max_new_tokens": max_tokens, "stream": not whole}
    if whole:
        got = (await client.post("/v1/generate", json=body)).raise_for_status().json()
        first = time.perf_counter() - sent
        return {"text": got["text"], "tokens": got["tokens"], "first_s": first, "whole_s": first}
    first, done = None, {}
    async with client.stream("POST", "/v1/generate", json=body) as events:
        async for line in events.raise_for_status().aiter_lines():
            if line.startswith("event: token"):
                first = first or time.perf_counter() - sent
            elif line.startswith("data: "):
                done = json.loads(line[len("data: ") :])  # the last is done's: the whole text
    return {**done, "first_s": first or float("nan"), "whole_s": time.perf_counter() - sent}


def chat_client(url: str, args):
    """The pattern's client and its ask(model, question, max_tokens, after=...) coroutine."""
    if args.route == "generate":
        import httpx

        client = httpx.AsyncClient(base_url=url, timeout=600)
        return client, lambda m, q, n, after=0.0: continuation(client, m, q, n, whole=args.whole, after=after)
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    if args.whole:
        return client, lambda m, q, n, after=0.0: whole_chat(client, m, q, n, after=after)
    return client, lambda m, q, n, after=0.0: chat(client, m, q, n, after=after)


async def whole_chat(client, model: str, question: str, max_tokens: int, *, after: float = 0.0) -> dict:
    """One greedy chat, not streamed, measured as :func:`chat` (its first piece is its whole answer)."""
    await asyncio.sleep(after)
    sent = time.perf_counter()
    messages = [{"role": "user", "content": question}]
    got = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    took = time.perf_counter() - sent
    return {
        "text": got.choices[0].message.content,
        "tokens": got.usage.completion_tokens,
        "first_s": took,
        "whole_s": took,
    }


async def pattern(url: str, model: str, name: str, args) -> dict:
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.chats)]
    client, ask = chat_client(url, args)
    async with client:
        await ask(model, "Hello!", 8)  # warm-up
        start = time.perf_counter()
        if name == "sequential":
            answers = [await ask(model, q, args.max_tokens) for q in questions]
        else:
            gap = args.gap if name == "staggered" else 0.0
            jobs = [ask(model, q, args.max_tokens, after=i * gap) for i, q in enumerate(questions)]
            answers = list(await asyncio.gather(*jobs))
        wall = time.perf_counter() - start
    tokens = sum(a["tokens"] for a in answers)
    return {
        "pattern": name,
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "mean_first_s": round(statistics.mean(a["first_s"] for a in answers), 3),
        "mean_whole_s": round(statistics.mean(a["whole_s"] for a in answers), 3),
        "texts": [a["text"] for a in answers],
    }


def run_setting(args, *, batching: bool) -> list[dict]:
    flags = ["--max-active", "256", "--timeout", "600"] + ([] if batching else ["--no-batching"])
    name = Path(args.model).name
    with serving("chat_batching", args.model, flags, threads=args.threads, wait=180) as (_, url):
        rows = []
        for p in ("sequential", "together", "staggered"):
            rows.append(asyncio.run(pattern(url, name, p, args)))
            print(f"batching {'on' if batching else 'off'}, {p}: {rows[-1]['wall_s']} s", flush=True)
    sequential = rows[0]["texts"]
    for row in rows:
        row["batching"] = batching
        row["same_as_sequential"] = row.pop("texts") == sequential
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="/tmp/sb_smollm2", help="a language model directory (qkv import-gguf)")
    parser.add_argument("--chats", type=int, default=8, help="chats per pattern (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer at most (default: 32)")
    parser.add_argument("--gap", type=float, default=0.25, help="seconds between staggered chats (default: 0.25)")
    parser.add_argument("--threads", type=int, default=2, help="the server's OMP_NUM_THREADS (default: 2)")
    parser.add_argument(
        "--route", choices=("chat", "generate"), default="chat", help="OpenAI's chat (default) or /v1/generate"
    )
    parser.add_argument("--whole", action="store_true", help="answers not streamed")
    parser.add_argument("--note", default="", help="for the record's notes (e.g. measured under contention)")
    parser.add_argument("--no-record", action="store_true", help="print only; append nothing to bench/results")
    args = parser.parse_args(argv)
    if not Path(args.model).is_dir():
        parser.error(f"--model {args.model}: no such directory")
    rows = [r for batching in (True, False) for r in run_setting(args, batching=batching)]
    print(f"{'batching':>8} {'pattern':>10} {'wall s':>7} {'tok/s':>7} {'first s':>8} {'whole s':>8} same")
    for r in rows:
        print(
            f"{'on' if r['batching'] else 'off':>8} {r['pattern']:>10} {r['wall_s']:7.2f} {r['tokens_per_s']:7.1f} "
            f"{r['mean_first_s']:8.2f} {r['mean_whole_s']:8.2f} {r['same_as_sequential']}"
        )
    if not args.no_record:
        from record import append_run

        sequential = next(r for r in rows if r["batching"] and r["pattern"] == "sequential")
        what = ("chat" if args.route == "chat" else "/v1/generate") + (" (whole)" if args.whole else "")
        notes = (
            f"{args.chats} chats x {args.max_tokens} tokens, {args.threads} threads, model {args.model}, "
            f"route {args.route}{', whole' if args.whole else ''}; {args.note}"
        )
        append_run(
            "chat_batching",
            [
                {
                    "metric": f"{what} tokens/s, {r['pattern']}, batching {'on' if r['batching'] else 'off'}",
                    "figure": r["tokens_per_s"],
                    "unit": "tokens/s",
                    "peer": "the same chats one after another",
                    "peer_figure": sequential["tokens_per_s"],
                    "details": r,
                    "notes": notes,
                }
                for r in rows
            ],
        )
    return 0 if all(r["same_as_sequential"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
