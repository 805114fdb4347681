"""The routes of the page's speech, speech-out and chat views, in-process (Starlette's TestClient),
against the library: ``/v1/audio/attention`` reads a segment's tokens over its stretch and gives a
softmax per token over the encoder positions that hold it; ``/v1/audio/speech/attention`` gives the
frames ``/v1/audio/speech``'s speech was made of and one decoder step per r of them; ``/v1/chat/attention``
gives the row of ``inspection.attention_maps`` from the step that wrote the token. Tiny random models
(tests/serving.py); the page that draws them is tests/test_serve_browser.py's."""

from __future__ import annotations

import math

import pytest
import torch
from fastapi.testclient import TestClient

from qkv.bundle import speeches
from qkv.inspection import attention_maps
from qkv.serve.app import create_app
from qkv.serve.models import load_served
from qkv.tokenization import FILE, Tokenizer
from serving import CHARACTERS, tiny_audio_models, tone


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from test_openai_api import TEMPLATE, tiny_lm

    root = tmp_path_factory.mktemp("views")
    audio = tiny_audio_models(root)
    tokenizer = Tokenizer.train_char_level([CHARACTERS + "abcdefghijklmnopqrstuvwxyz:|?_"])
    (root / "chat").mkdir()
    tokenizer.save(root / "chat" / FILE)
    talk = tiny_lm(root / "chat", "talk", tokenizer, seed=0, template=TEMPLATE)
    return load_served([str(audio["asr"]), str(audio["tts"]), str(talk)])


@pytest.fixture(scope="module")
def client(served):
    with TestClient(create_app(served)) as c:
        yield c


def test_a_segments_cross_attention_over_its_stretch(client, served):
    wav = tone(0.7)
    heard = client.post(
        "/v1/audio/transcriptions", files={"file": ("t.wav", wav)}, data={"response_format": "verbose_json"}
    ).json()
    (segment,) = heard["segments"]
    form = {"start": "0.2", "end": "0.7", "tokens": ",".join(map(str, segment["tokens"]))}
    view = client.post("/v1/audio/attention", files={"file": ("t.wav", wav)}, data=form)
    assert view.status_code == 200, view.text
    view = view.json()
    asr = served["asr"]
    frames = 1 + round(0.5 * 16000) // asr.bundle.features.hop_length  # the stretch's frames
    assert len(view["mel"]) == frames and len(view["mel"][0]) == asr.bundle.features.n_mels
    columns = int(asr.model.subsampled(torch.tensor([frames]))[0])
    assert len(view["cross"]) == asr.model.config.n_decoder_layers and len(view["cross"][0]) == view["heads"]
    for head in view["cross"][-1]:
        assert len(head) == len(segment["tokens"]) == len(view["tokens"])
        assert all(len(row) == columns and sum(row) == pytest.approx(1, abs=1e-3) for row in head)
    assert (view["start"], view["end"]) == (0.2, pytest.approx(0.7))
    too_long = {**form, "tokens": ",".join(["5"] * (asr.model.config.max_len + 1))}
    refused = client.post("/v1/audio/attention", files={"file": ("t.wav", wav)}, data=too_long)
    assert refused.status_code == 422 and "writes at most" in refused.json()["error"]["message"]


def test_speech_attention_is_of_the_speech_the_speech_route_makes(client, served):
    tts, text = served["tts"], "do re mi. mi re."
    view = client.post("/v1/audio/speech/attention", json={"input": text}).json()
    said = speeches(tts.bundle, ["do re mi.", "mi re."], seed=0)  # as /v1/audio/speech speaks it
    mel = torch.cat([s.mel for s, _ in said])  # (T, M)
    assert torch.tensor(view["mel"]).sub(mel).abs().max() < 0.006  # 2 decimals
    r = tts.model.config.reduction
    steps = sum(math.ceil(s.mel.shape[0] / r) for s, _ in said)
    assert len(view["steps"]) == steps and view["steps"][-1][1] == mel.shape[0]
    assert [len(t) for t in view["tokens"]] == [len("do re mi."), len("mi re.")]
    for head in view["cross"][0]:  # block by block: a step of a sentence reads only its own letters
        assert len(head) == steps and all(len(row) == len(text) - 1 for row in head)
        first = math.ceil(said[0][0].mel.shape[0] / r)
        assert all(sum(row[:9]) == pytest.approx(1, abs=1e-3) and sum(row[9:]) == 0 for row in head[:first])
        assert all(sum(row[9:]) == pytest.approx(1, abs=1e-3) and sum(row[:9]) == 0 for row in head[first:])


def test_chat_attention_is_the_row_that_wrote_the_token(client, served):
    talk = served["talk"]
    messages = [{"role": "user", "content": "Hello there"}]
    view = client.post("/v1/chat/attention", json={"messages": messages, "answer": "a dog", "token": 2}).json()
    tokenizer = talk.vocab.source
    prompt = tokenizer.encode(talk.bundle.conversation.render(messages), add_special_tokens=False)
    said = tokenizer.encode("a dog", add_special_tokens=False)
    assert view["answer_start"] == len(prompt) and view["row"] == len(prompt) + 1
    maps = attention_maps(talk.model, prompt, said).decoder
    for layer, found in zip(maps, view["weights"], strict=True):
        assert torch.tensor(found).sub(layer[:, len(prompt) + 1, : len(prompt) + 2]).abs().max() < 6e-5
    refused = client.post("/v1/chat/attention", json={"messages": messages, "answer": "a dog", "token": 5})
    assert refused.status_code == 422 and "0 to 4" in refused.json()["error"]["message"]
