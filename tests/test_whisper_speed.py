"""bench/whisper_speed.py's scoring and records, on transcripts and figures made here (the
benchmark itself runs Whisper tiny.en in six processes: minutes, not a test)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    """bench/whisper_speed.py as a module (bench/ on the path for its imports)."""
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_whisper_speed", ROOT / "bench" / "whisper_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_transcripts_are_read_as_digit_words(bench) -> None:
    assert bench.spoken_words("Zero. Oh, 7!") == ["zero", "zero", "seven"]
    assert bench.spoken_words("573 to-day") == ["five", "seven", "three", "today"]
    assert bench.spoken_words("[BLANK_AUDIO]") == ["blankaudio"]
    assert bench.wer(["one", "two"], ["1.", "Two!"]) == 0
    assert bench.wer(["one two", "three"], ["one", "three four"]) == pytest.approx(100 * 2 / 3)


def test_a_looping_transcript_scores_its_insertions(bench) -> None:
    # tiny.en on joined digits writes "7, 7, 7, ..." to a window's token limit: 12 words heard for 4
    # said, 2 of them right, so 10 errors (2 substitutions, 8 insertions), and two loops of the same
    # length score the same whichever digit repeats.
    said = "one two three four"
    assert bench.wer([said], ["1, 2, " + "7, " * 10]) == pytest.approx(100 * 10 / 4)
    assert bench.wer([said], ["1, 2, " + "5, " * 10]) == bench.wer([said], ["1, 2, " + "7, " * 10])
    assert bench.wer(["A man, in a hat."], ["a man in the hat"]) == pytest.approx(100 / 5)


def row(seconds: float, wer: float, audio: float = 300.0, **more) -> dict:
    return {"seconds": seconds, "x_real_time": round(audio / seconds, 1), "peak_mib": 400, "wer": wer, **more}


def test_records_put_each_qkv_row_beside_its_peer(bench) -> None:
    rows = {
        "transformers fp32": row(100.0, 2.0, same_as_reference=300),
        "qkv fp32": row(50.0, 2.0, same_as_reference=299),
        "qkv int8": row(20.0, 2.9, same_as_reference=290),
        "faster-whisper int8": row(25.0, 2.3, same_as_reference=295),
    }
    results = {"fsdd": {"files": 300, "audio_seconds": 300.0, "rows": rows}}
    found = {r["metric"]: r for r in bench.records(results, beam=1, notes="contended")}
    fp32 = found["Whisper tiny.en FSDD test 300 files beam 1: qkv fp32"]
    assert (fp32["figure"], fp32["peer_figure"], fp32["target"]) == (6.0, 3.0, {"min_ratio": 1.2})
    int8 = found["Whisper tiny.en FSDD test 300 files beam 1: qkv int8"]
    assert (int8["figure"], int8["peer"], int8["peer_figure"]) == (15.0, "faster-whisper int8", 12.0)
    assert int8["details"]["agreement with transformers fp32"] == 290 and int8["notes"] == "contended"
    fastest = found["Whisper tiny.en FSDD test 300 files beam 1: qkv's fastest mode"]
    assert fastest["details"]["mode"] == "qkv int8" and fastest["target"] == {"min_ratio": 1.0}
    gap = found["Whisper tiny.en FSDD test 300 files beam 1: qkv's fastest mode, WER above transformers fp32's"]
    assert gap["figure"] == pytest.approx(0.9) and gap["target"] == {"max": 0.5}


def test_without_the_peers_only_our_rows_are_recorded(bench) -> None:
    rows = {"qkv bf16": row(30.0, 1.0, audio=600.0)}
    results = {"long": {"files": 1, "audio_seconds": 600.0, "rows": rows}}
    found = bench.records(results, beam=5)
    assert [r["metric"] for r in found] == ["Whisper tiny.en long-form 10 min greedy: qkv bf16"]
    assert found[0]["peer_figure"] is None


def test_a_batched_row_is_beside_the_batched_peer(bench) -> None:
    """qkv's batched long-form beside faster-whisper's batched pipeline, and never qkv's fastest
    mode beside faster-whisper's sequential windows (a different way of reading the file)."""
    rows = {
        "transformers fp32": row(100.0, 5.0, audio=180.0),
        "qkv int8": row(9.0, 6.0, audio=180.0),
        "faster-whisper int8": row(8.0, 6.5, audio=180.0),
        "qkv int8 batched": row(4.0, 6.1, audio=180.0),
        "faster-whisper int8 batched": row(5.0, 6.4, audio=180.0),
    }
    results = {"long": {"files": 1, "audio_seconds": 180.0, "rows": rows, "workload": "speech"}}
    found = {r["metric"]: r for r in bench.records(results, beam=1)}
    batched = found["Whisper tiny.en long-form speech 3 min greedy: qkv int8 batched"]
    assert (batched["peer"], batched["figure"], batched["peer_figure"]) == ("faster-whisper int8 batched", 45.0, 36.0)
    assert found["Whisper tiny.en long-form speech 3 min greedy: qkv's fastest mode"]["details"]["mode"] == "qkv int8"
