"""Tests of the Llama family in and out of qkv: Llama (each RoPE scaling), Qwen2, Mistral, Gemma 3.

Small random models built with ``transformers`` (D=18 with H=3 and G=1 key/value head, F=22, 3
layers, vocabulary of a byte-level BPE trained here; Gemma 3 with wider heads K=6 than D/H;
weights moved off their initial values so every tensor matters) are saved with
``save_pretrained``, imported, compared with the original (logits within 1e-4 with padding,
greedy generations identical, tokenization identical on accents, CJK, emoji, code and empty
lines), exported back, loaded with ``from_pretrained`` and compared again. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from qkv.checkpoint import load_model, save_model  # noqa: E402
from qkv.cli.main import main  # noqa: E402
from qkv.decoding import greedy  # noqa: E402
from qkv.errors import UserError  # noqa: E402
from qkv.hf.convert import export_hf, import_hf  # noqa: E402
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig  # noqa: E402
from qkv.tokenization import Tokenizer  # noqa: E402

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

ATOL = 1e-4
TEXTS = [
    "Hello world, this is a tiny corpus.",
    "Café naïve résumé: 123 456 7.5%",
    "東京で寿司を食べた 🚀🍣 and 한국어",
    "def f(x):\n    return x ** 2  # code\n",
    "first line\n\n\nafter empty lines\n",
    "",
]
CORPUS = TEXTS * 10 + ["a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 . , ! ?"]
BOS, EOS, START, END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen2's pre-tokenizer (its tokenizer.json's, which transformers' Qwen2Tokenizer rebuilds).
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def write_tokenizer(directory: Path, *, bos: bool) -> None:
    """A byte-level BPE trained here, saved as a checkpoint holds it with a ChatML template: with
    BEGIN added by its post-processor (``bos``: Llama 3's), else as Qwen2's (NFC, its split)."""
    backend = HFTokenizer(models.BPE())
    if bos:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[BOS, EOS, START, END], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    if bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, backend.token_to_id(BOS))]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS if bos else None,
        "eos_token": END,
        "chat_template": TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter off its initial value (norms 1 or 0, zero biases)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.1))


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a - b).abs().max().item() <= ATOL, (a - b).abs().max().item()


def hf_greedy(model, prompts: list[list[int]], *, pad: int, eos: int, new: int) -> list[list[int]]:
    """HF greedy decoding of a left-padded batch; the new tokens of each row, cut before END."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=new, pad_token_id=pad
    )
    return [row[: row.index(eos)] if eos in row else row for row in out[:, width:].tolist()]


SMALL = {"hidden_size": 18, "intermediate_size": 22, "num_hidden_layers": 3, "num_attention_heads": 3}
# Each family with the settings that make it more than Llama; each RoPE scaling on Llama.
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"rope_theta": 500.0}),
    "llama-linear": (LlamaConfig, LlamaForCausalLM, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-dynamic": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 13},
    ),
    "llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "rope_theta": 500.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        },
    ),
    "llama-yarn": (
        LlamaConfig,
        LlamaForCausalLM,
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}},
    ),
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1, "tie_word_embeddings": True},
    ),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 5}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "hidden_size": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 6,
            "sliding_window": 5,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 5,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
    ),
}


def hf_model(family: str, vocab: int, ids: dict) -> torch.nn.Module:
    config_class, model_class, extra = FAMILIES[family]
    fields = {**SMALL, "num_key_value_heads": 1, "max_position_embeddings": 64, **extra, **ids}
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=vocab, **fields)).eval()
    perturb(model, 1)
    return model


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[bool, Path]:
    """Tokenizer files with and without BEGIN, trained once."""
    found = {}
    for bos in (True, False):
        directory = tmp_path_factory.mktemp(f"tokenizer_bos_{bos}")
        write_tokenizer(directory, bos=bos)
        found[bos] = directory
    return found


def checkpoint(family: str, tokenizer_dirs: dict[bool, Path], directory: Path):
    """A random ``family`` checkpoint with a tokenizer (Qwen2's without BEGIN), saved in
    ``directory``: (the HF model, its tokenizer)."""
    bos = family != "qwen2"
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dirs[bos])
    end = hf_tokenizer.convert_tokens_to_ids(END)
    ids = {"bos_token_id": hf_tokenizer.convert_tokens_to_ids(BOS), "eos_token_id": end, "pad_token_id": end}
    model = hf_model(family, len(hf_tokenizer), ids)
    model.save_pretrained(directory)
    hf_tokenizer.save_pretrained(directory)
    return model, hf_tokenizer


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_family_round_trip(family: str, tokenizer_dirs, tmp_path: Path, capsys) -> None:
    """HF -> decoder_only -> HF: logits with padding (past the sliding window and the pretraining
    window of the RoPE scalings), greedy generations and tokenization agree."""
    hf, hf_tokenizer = checkpoint(family, tokenizer_dirs, tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "qkv"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["architecture"] == type(hf).__name__ and summary["kind"] == "decoder_only"
    assert summary["ignored"] == []
    model, _ = load_model(tmp_path / "qkv")
    assert isinstance(model, DecoderOnly)

    tokens = torch.randint(5, len(hf_tokenizer), (3, 15), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(3, 15, dtype=torch.bool)
    mask[1, 8:] = False  # right padding: the real tokens must not see it
    with torch.no_grad():
        expected = hf(input_ids=tokens, attention_mask=mask.long()).logits
        ours = model.decode(tokens, key_mask=mask).logits
    assert_close(ours[mask], expected[mask])

    tokenizer = Tokenizer.load(tmp_path / "qkv" / "tokenizer.json")
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer(text).input_ids, text
        assert tokenizer.decode(tokenizer.encode(text)) == hf_tokenizer.decode(
            hf_tokenizer(text).input_ids, skip_special_tokens=True
        )
    end = hf_tokenizer.convert_tokens_to_ids(END)
    prompts = [tokenizer.encode(t) for t in ("Hello world", "東京", "a")]
    # Within the window of every model here: transformers grows a dynamic RoPE's base for the
    # whole batch once one row's positions pass it, where qkv's window ends each row.
    generated = greedy(model, prompts, max_new_tokens=5)
    assert generated == hf_greedy(hf, prompts, pad=end, eos=end, new=5)
    assert any(len(set(row)) > 2 for row in generated)  # the model does not just repeat one token

    out = tmp_path / "exported"
    assert main(["export-hf", str(tmp_path / "qkv"), str(out)]) == 0
    assert type(hf).__name__ in capsys.readouterr().out
    back, info = type(hf).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert_close(back.eval()(input_ids=tokens, attention_mask=mask.long()).logits[mask], expected[mask])
    back_tokenizer = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        assert back_tokenizer(text).input_ids == hf_tokenizer(text).input_ids, text
    assert back_tokenizer.chat_template == TEMPLATE


def test_sharded_safetensors_import_as_one_file(tokenizer_dirs, tmp_path: Path) -> None:
    """A checkpoint saved in shards (model.safetensors.index.json) imports as the same model."""
    hf, _ = checkpoint("llama", tokenizer_dirs, tmp_path / "one")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    import_hf(tmp_path / "one", tmp_path / "qkv_one")
    import_hf(tmp_path / "sharded", tmp_path / "qkv_sharded")
    one, _ = load_model(tmp_path / "qkv_one")
    sharded, _ = load_model(tmp_path / "qkv_sharded")
    for (name, a), (_, b) in zip(one.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    victim = sorted(index["weight_map"])[0]
    index["weight_map"][victim] = "missing.safetensors"
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(UserError, match=r"shard 'missing\.safetensors'"):
        import_hf(tmp_path / "sharded", tmp_path / "qkv_bad")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
        ({"attention_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ],
)
def test_what_qkv_cannot_compute_is_refused_by_field(change: dict, named: str, tokenizer_dirs, tmp_path) -> None:
    checkpoint("llama", tokenizer_dirs, tmp_path / "hf")
    fields = json.loads((tmp_path / "hf" / "config.json").read_text())
    fields.pop("rope_parameters")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**fields, **change}))
    with pytest.raises(UserError, match=named) as error:
        import_hf(tmp_path / "hf", tmp_path / "qkv")
    assert "config.json" in str(error.value)
    assert not (tmp_path / "qkv").exists()


def test_old_style_rope_fields_are_read(tokenizer_dirs, tmp_path: Path) -> None:
    """transformers 4.x's rope_theta and rope_scaling ({"type": ...}) give the model that
    transformers 5.x's rope_parameters give."""
    checkpoint("llama3", tokenizer_dirs, tmp_path / "new")
    import_hf(tmp_path / "new", tmp_path / "qkv_new")
    fields = json.loads((tmp_path / "new" / "config.json").read_text())
    parameters = fields.pop("rope_parameters")
    theta = parameters.pop("rope_theta")
    parameters["type"] = parameters.pop("rope_type")
    (tmp_path / "new" / "config.json").write_text(
        json.dumps({**fields, "rope_theta": theta, "rope_scaling": parameters})
    )
    import_hf(tmp_path / "new", tmp_path / "qkv_old")
    new, _ = load_model(tmp_path / "qkv_new")
    old, _ = load_model(tmp_path / "qkv_old")
    assert new.config == old.config and old.config.rope_base == 500.0 and old.config.rope_scaling.kind == "llama3"


def test_a_native_rope_model_exports_as_llama(tmp_path: Path) -> None:
    """A qkv-trained RoPE model with RMSNorm and SwiGLU, no biases, is a Llama; one with
    LayerNorm is refused, naming the field."""
    fields = {"d_model": 18, "n_heads": 3, "n_kv_heads": 1, "d_ff": 11, "vocab_size": 13, "n_layers": 2}
    llama = DecoderOnlyConfig(
        **fields, positions="rope", norm="rmsnorm", activation="swiglu", bias=False, scale_embeddings=False
    )
    torch.manual_seed(0)
    native = DecoderOnly(llama).eval()
    perturb(native, 3)
    save_model(native, tmp_path / "native")
    summary = export_hf(tmp_path / "native", tmp_path / "hf")
    assert summary["architecture"] == "LlamaForCausalLM"
    back = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 13, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_close(back(input_ids=tokens).logits, native(tokens))
    save_model(DecoderOnly(DecoderOnlyConfig(**fields, positions="rope")), tmp_path / "layernorm")
    with pytest.raises(UserError, match=r"LlamaForCausalLM.*norm='rmsnorm'"):
        export_hf(tmp_path / "layernorm", tmp_path / "hf2")


@pytest.mark.parametrize("family", ["llama-linear", "llama-dynamic", "llama3", "llama-yarn"])
def test_rope_frequencies_are_transformers(family: str) -> None:
    """Each scaling's inverse frequencies and cos/sin factor equal transformers' own functions'
    (dynamic: at a length inside the window and one past it)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from qkv.hf.common import HFConfig
    from qkv.hf.llama import rope_of
    from qkv.positions import RopeScaling, rope_frequencies

    config_class, _, extra = FAMILIES[family]
    hf_config = config_class(**{**SMALL, "num_key_value_heads": 1, "max_position_embeddings": 64, **extra})
    base, scaling = rope_of(HFConfig(Path("config.json"), hf_config.to_dict()))
    kind = hf_config.rope_parameters["rope_type"]
    for length in (5, 40) if kind == "dynamic" else (0,):
        theirs, factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", seq_len=length or None)
        ours, our_factor = rope_frequencies(6, base=base, scaling=RopeScaling(**scaling), length=length)
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=0), (ours, theirs)
        assert our_factor == pytest.approx(factor)
