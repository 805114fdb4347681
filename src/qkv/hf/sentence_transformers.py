"""sentence-transformers directories: what ``qkv import-hf`` reads of them, and the window it records.

A sentence-transformers checkpoint is a Hugging Face checkpoint plus a pipeline, named in
``modules.json``: a ``Transformer`` module (the HF model, in the directory itself or a folder
such as ``0_Transformer``, with ``sentence_bert_config.json``: ``max_seq_length``,
``do_lower_case``), a ``Pooling`` module (``1_Pooling/config.json``: CLS, mean, max or mean
over the square root of the length) and optionally ``Normalize`` (unit length; it has no files,
and its folder may be missing). What is here: :func:`read_sentence_transformers` (that pipeline,
or None for a directory without ``modules.json``), :func:`window` (the number of tokens a
checkpoint's users get: what sentence-transformers or transformers' ``truncation=True`` cuts a
text to) and :func:`lowercase_first` (``do_lower_case``, as sentence-transformers applies it).

Modules qkv does not reproduce (``Dense``, ``LayerNorm``, ``WordEmbeddings``, a ``Router``,
several pooling modes at once, ``weightedmean`` or ``lasttoken`` pooling) are named in
:attr:`SentenceTransformers.unsupported`; import still converts the Transformer, and says that
its embeddings are not the checkpoint's. What is not here: the conversion itself (``convert.py``)
and the pooling (``qkv/embedding.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers

from qkv.embedding import POOLINGS
from qkv.errors import UserError
from qkv.files import read_json_object
from qkv.hf.common import TokenizerSettings

MODULES = "modules.json"
ST_CONFIG = "sentence_bert_config.json"
# sentence-transformers' pooling names (legacy booleans and the newer pooling_mode) -> qkv's.
POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
POOLING_NAMES = {"cls": "cls", "max": "max", "mean": "mean", "mean_sqrt_len_tokens": "mean_sqrt_len"}


@dataclass
class SentenceTransformers:
    """What a sentence-transformers directory asks for: ``model_dir`` (the Transformer module's
    folder: config.json, weights, tokenizer), ``pooling`` (one of qkv's, None when the pipeline
    has none or one qkv cannot compute), ``normalize``, ``max_seq_length`` and ``lowercase``
    (``sentence_bert_config.json``), ``read`` (the files that said so, relative to the
    directory) and ``unsupported`` (what qkv does not reproduce, in words)."""

    model_dir: Path
    pooling: str | None = None
    normalize: bool = False
    max_seq_length: int | None = None
    lowercase: bool = False
    read: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)

    def source(self) -> str:
        return f"sentence-transformers: {', '.join(self.read)}"


def read_sentence_transformers(directory: Path) -> SentenceTransformers | None:
    """The pipeline of the sentence-transformers directory ``directory`` (None without
    ``modules.json``); errors name the file and the field."""
    path = directory / MODULES
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UserError(f"{path} must be a JSON list of modules (objects with 'type' and 'path')")
    found = SentenceTransformers(model_dir=directory, read=[MODULES])
    transformers = 0
    for i, module in enumerate(modules):
        kind, folder = module.get("type"), module.get("path", "")
        if not isinstance(kind, str) or not isinstance(folder, str):
            raise UserError(f"{path}: module {i} must have a string 'type' and 'path', got {module!r}")
        name = kind.rsplit(".", 1)[-1]
        where = directory / folder
        if name == "Transformer" and i == 0:
            transformers += 1
            found.model_dir = where
            _read_transformer(found, directory, where)
        elif (
            name == "Pooling" and found.pooling is None and not any(u.startswith("Pooling") for u in found.unsupported)
        ):
            _read_pooling(found, directory, where)
        elif name == "Normalize":
            found.normalize = True
            found.read.append(f"{MODULES}: Normalize")
        else:
            found.unsupported.append(f"module {folder or '.'} ({name})")
    if not transformers:
        raise UserError(f"{path}: the first module must be a Transformer (the Hugging Face model qkv imports)")
    if found.pooling is None and not any(u.startswith("Pooling") for u in found.unsupported):
        found.unsupported.append("no Pooling module (the pipeline gives token vectors, not one per sentence)")
    return found


def _read_transformer(found: SentenceTransformers, directory: Path, where: Path) -> None:
    config = where / ST_CONFIG
    if not config.is_file():
        return
    fields = read_json_object(config)
    max_seq_length, lowercase = fields.get("max_seq_length"), fields.get("do_lower_case", False)
    if max_seq_length is not None and (
        isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length < 1
    ):
        raise UserError(f"{config}: field 'max_seq_length' must be a positive integer or null, got {max_seq_length!r}")
    if not isinstance(lowercase, bool):
        raise UserError(f"{config}: field 'do_lower_case' must be true or false, got {lowercase!r}")
    found.max_seq_length, found.lowercase = max_seq_length, lowercase
    found.read.append(str(config.relative_to(directory)))


def _read_pooling(found: SentenceTransformers, directory: Path, where: Path) -> None:
    config = where / "config.json"
    if not config.is_file():
        raise UserError(f"{config} is missing: {directory / MODULES} names a Pooling module there")
    fields = read_json_object(config)
    mode = fields.get("pooling_mode")
    if mode is not None:
        modes = [mode] if isinstance(mode, str) else mode
        if not isinstance(modes, list) or not modes or not all(isinstance(m, str) for m in modes):
            raise UserError(f"{config}: field 'pooling_mode' must be a mode name or a list of them, got {mode!r}")
        modes = [POOLING_NAMES.get(m, m) for m in modes]
    else:
        flags = {k: fields[k] for k in POOLING_FLAGS if k in fields}
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise UserError(f"{config}: field {key!r} must be true or false, got {value!r}")
        modes = [POOLING_FLAGS[k] for k, on in flags.items() if on] or ["mean"]  # sentence-transformers' default
    if fields.get("include_prompt", True) is not True:
        found.unsupported.append("Pooling with include_prompt=false")
    rel = str(config.relative_to(directory))
    if len(modes) > 1:
        found.unsupported.append(f"Pooling of several modes at once ({', '.join(modes)}; {rel})")
    elif modes[0] not in POOLINGS:
        found.unsupported.append(f"Pooling mode {modes[0]} ({rel}); qkv pools by {', '.join(POOLINGS)}")
    else:
        found.pooling = modes[0]
    found.read.append(rel)


def window(positions: int, settings: TokenizerSettings, st: SentenceTransformers | None) -> tuple[int, str]:
    """The number of tokens (with [CLS] and [SEP]) the checkpoint's users have a text cut to, and
    which file says so: ``sentence_bert_config.json``'s ``max_seq_length`` (what
    sentence-transformers cuts to), else ``tokenizer_config.json``'s ``model_max_length`` (what
    transformers cuts to with ``truncation=True``), else the model's ``positions`` (BERT's
    ``max_position_embeddings``; a RoBERTa's less two); never more than ``positions``. A
    ``tokenizer.json``'s own truncation length is not used: transformers ignores it, as qkv does
    (``tokenization.py``)."""
    if st is not None and st.max_seq_length is not None:
        return min(st.max_seq_length, positions), f"{ST_CONFIG} max_seq_length {st.max_seq_length}"
    length = settings.get("model_max_length")
    if isinstance(length, int) and not isinstance(length, bool) and 0 < length < positions:
        return length, f"tokenizer_config.json model_max_length {length}"
    return positions, f"the model's {positions} positions (config.json)"


def _lowercases(spec: dict | None) -> bool:
    if not spec:
        return False
    if spec.get("type") == "Lowercase" or (spec.get("type") == "BertNormalizer" and spec.get("lowercase")):
        return True
    return spec.get("type") == "Sequence" and any(_lowercases(s) for s in spec.get("normalizers", []))


def lowercase_first(backend: HFTokenizer) -> bool:
    """Make ``backend`` lowercase every text before its own normalizer, unless that normalizer
    already lowercases (as sentence-transformers does with ``do_lower_case``); whether it changed."""
    spec = json.loads(backend.to_str()).get("normalizer")
    if _lowercases(spec):
        return False
    backend.normalizer = (
        normalizers.Sequence([normalizers.Lowercase(), backend.normalizer])
        if backend.normalizer is not None
        else normalizers.Lowercase()
    )
    return True
