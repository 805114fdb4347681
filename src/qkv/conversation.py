"""What a chat checkpoint says about conversing: its chat template, the tokens that end a turn,
and its sampling defaults.

What is here: :class:`Conversation` (a model directory's template, the special tokens the
template reads, the ids that end a reply, :class:`GenerationDefaults`), read once by
:meth:`Conversation.read` from the files an import keeps (``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template``; ``generation_config.json``), and
:meth:`Conversation.render`, which renders a list of messages ({"role", "content"}) as
transformers' ``apply_chat_template`` does: Jinja in an immutable sandbox (a template is code
from whoever published the checkpoint: it cannot reach Python's internals or change the data it
is given), ``trim_blocks`` and ``lstrip_blocks``, the loop controls, transformers' ``tojson``,
``raise_exception`` and ``strftime_now``, and the special tokens (``bos_token``, ``eos_token``,
...) as variables.

What is not here: fitting a conversation to the model's window and decoding the reply
(``chat.py``), the import that keeps the files (``hf/``). Rendering needs ``jinja2``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from qkv.errors import UserError
from qkv.files import read_json_object

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # the variables a template may read
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class GenerationDefaults:
    """How a checkpoint's authors have it sample (``generation_config.json``); None: the file
    does not say (qkv's default then applies: greedy, no penalty).

    Attributes:
        do_sample: draw each token (True) or take the most likely.
        temperature, top_k, top_p, min_p: the draw's settings (min-p: Nguyen et al., 2024).
        repetition_penalty: θ of CTRL's penalty (Keskar et al., 2019, section 4.1) on tokens
            already in the text.
        max_new_tokens: the longest reply.
    """

    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    @classmethod
    def read(cls, path: Path) -> GenerationDefaults:
        """The defaults of ``generation_config.json`` at ``path``; a field of the wrong type is refused by name."""
        fields = read_json_object(path)
        found = {}
        for name, kinds in (
            ("do_sample", (bool,)),
            ("temperature", (int, float)),
            ("top_k", (int,)),
            ("top_p", (int, float)),
            ("min_p", (int, float)),
            ("repetition_penalty", (int, float)),
            ("max_new_tokens", (int,)),
        ):
            value = fields.get(name)
            if value is None:
                continue
            if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
                raise UserError(f"{path}: field {name!r} must be a {kinds[-1].__name__}, got {value!r}")
            found[name] = value
        return cls(**found)


@dataclass(frozen=True)
class Conversation:
    """A chat checkpoint's way of conversing (see the module docstring).

    Attributes:
        template: the Jinja source of its chat template.
        tokens: the special tokens the template reads by name (``bos_token``: "<s>", ...).
        stops: the ids that end a reply (its END, and the end-of-turn tokens
            ``generation_config.json`` lists).
        defaults: its sampling defaults.
        source: the file the template came from (named in errors).
    """

    template: str
    tokens: Mapping[str, str] = field(default_factory=dict)
    stops: tuple[int, ...] = ()
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    source: Path | None = None

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model reads it: ``messages`` (role and content each) through the
        template, ending with the start of the assistant's turn when ``add_generation_prompt``. A
        template's own refusal (``raise_exception``: say, a system message it does not take) and
        anything the sandbox forbids are a UserError naming the template's file."""
        import jinja2

        compiled = _compiled(self.template, self.source)
        try:
            return compiled.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.tokens,
            )
        except jinja2.TemplateError as e:  # SecurityError is one
            raise UserError(
                f"the chat template of {self.source or 'the model'} refused the conversation: {e}"
            ) from None

    @classmethod
    def read(
        cls, directory: Path, files: Collection[str], *, eos_id: int | None, token_of: Callable[[int], str | None]
    ) -> Conversation | None:
        """The conversation of a model directory whose listed ``files`` hold a chat template
        (None: none does); ``eos_id``, the model's END, always ends a reply; ``token_of``
        maps an id to its token (for generation_config.json's END ids)."""
        settings = read_json_object(directory / TOKENIZER_CONFIG) if TOKENIZER_CONFIG in files else {}
        if TEMPLATE_FILE in files:
            source = directory / TEMPLATE_FILE
            template = source.read_text(encoding="utf-8")
        else:
            source = directory / TOKENIZER_CONFIG
            template = _template_in(settings.get("chat_template"), source)
        if template is None:
            return None
        tokens = {name: _token_text(settings.get(name)) for name in SPECIAL_TOKENS}
        defaults, stops = GenerationDefaults(), [] if eos_id is None else [eos_id]
        if GENERATION_CONFIG in files:
            path = directory / GENERATION_CONFIG
            defaults = GenerationDefaults.read(path)
            stops += _ids(read_json_object(path).get("eos_token_id"), path)
        if tokens["eos_token"] is None and stops:
            tokens["eos_token"] = token_of(stops[0])
        return cls(
            template=template,
            tokens={k: v for k, v in tokens.items() if v is not None},
            stops=tuple(dict.fromkeys(stops)),
            defaults=defaults,
            source=source,
        )


def _template_in(value: object, source: Path) -> str | None:
    """tokenizer_config.json's chat_template: one template, or a list of named ones (the "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise UserError(f"{source}: field 'chat_template' must be a template, or a list of named ones with a 'default'")


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: text, or {"content": text}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: object, path: Path) -> list[int]:
    """One id or a list of them."""
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise UserError(f"{path}: field 'eos_token_id' must be token ids, got {value!r}")
    return values


@functools.cache
def _compiled(template: str, source: Path | None):
    """The template compiled in transformers' sandboxed environment (its filters and globals),
    once per template: a chat renders it every turn."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # transformers' own: Jinja's escapes HTML characters, which a prompt must keep.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"the chat template of {source or 'the model'} is not valid Jinja: {e}") from None
