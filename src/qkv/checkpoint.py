"""Model directories: save and load a model as ``config.json`` + ``model.safetensors``.

A model directory holds:
    config.json         {"qkv_version", "kind", "config": {...}, "files": {name: sha256}, ...}
    model.safetensors   the weights (tied tensors stored once); never pickle
    other files         e.g. tokenizer.json, listed with their SHA-256 under "files"

A training checkpoint of a model sharded by FSDP (``runs.save_checkpoint``) holds, instead of
``model.safetensors``, the pieces every worker wrote in parallel through
``torch.distributed.checkpoint`` (its Hugging Face storage: one safetensors file per worker,
``shard-NNNNN-model-00001-of-00001.safetensors``, NNNNN = rank + 1, each piece's offsets in its header), weights
under ``model.NAME`` beside the trainer's ``trainer.NAME``; config.json says ``"sharded": N``.
:func:`load_model` reads such a directory into an ordinary whole model on one process (the
conversion for use and export); :func:`read_shards` reads it into any sharding of any N.

Writes are atomic (``files.atomic_directory``): everything is written into a temporary
sibling directory, flushed to disk, that then replaces the target, so a crash never leaves a
half-written model (directories cannot be swapped in one rename, so for an instant the previous
version sits at ``.NAME.old``). Loading checks every file and tensor against the config and
refuses, naming the problem, with a :class:`~qkv.errors.UserError`.

What is not here: training state (optimizer, schedule; ``training.py``), tokenizer logic
(``tokenization.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.overrides import TorchFunctionMode

from qkv import __version__
from qkv.errors import UserError
from qkv.files import atomic_directory, check_writable, file_problem, read_json_object, sha256_file, storage_errno
from qkv.memory import available_memory, human_bytes
from qkv.models.decoder_only import DecoderOnly, DecoderOnlyConfig
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.models.encoder_only import EncoderOnly, EncoderOnlyConfig
from qkv.models.speech import SpeechConfig, SpeechEncoderDecoder
from qkv.models.tts import TransformerTTS, TTSConfig
from qkv.models.vits import Vits, VitsConfig

KINDS = ("encoder_decoder", "encoder_only", "decoder_only", "speech_encoder_decoder", "tts", "vits")
RUN_FILE = "run.json"  # marks a training run directory (``runs.py``)
SHARDED = "sharded"  # config.json: how many workers wrote the weights as shards (save_shards)
WEIGHTS = "model."  # the weights' keys among a sharded checkpoint's tensors
# What a task that trains into its model directory keeps there while it runs: the resumable
# checkpoint, the best validated one and those kept for averaging, TensorBoard's scalars, and
# the pieces a killed save left (".NAME.*"). The run's final save replaces them (TensorBoard's
# are carried over).
RUN_ENTRY = re.compile(r"\.?(last|best|averaged|tensorboard|epoch-\d+|step-\d+)(\..*)?")
# safetensors' dtype names (what _header reports) for the tensors a checkpoint holds
DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "U8": torch.uint8,
    "I64": torch.int64,
    "I32": torch.int32,
    "BOOL": torch.bool,
}
# The largest integer a config field may hold (sizes, ids, the window: PyTorch indexes with them),
# and the most layers in one stack (published Transformers have at most a few hundred; building
# a model takes time per layer before anything can be checked).
MAX_SIZE = 2**31 - 1
MAX_LAYERS = 1024
Model = EncoderDecoder | EncoderOnly | DecoderOnly | SpeechEncoderDecoder | TransformerTTS | Vits
Config = EncoderDecoderConfig | EncoderOnlyConfig | DecoderOnlyConfig | SpeechConfig | TTSConfig | VitsConfig


def kind_of(model: nn.Module) -> str:
    """The kind name stored in ``config.json`` for a model instance."""
    if isinstance(model, EncoderDecoder):
        return "encoder_decoder"
    if isinstance(model, EncoderOnly):
        return "encoder_only"
    if isinstance(model, DecoderOnly):
        return "decoder_only"
    if isinstance(model, SpeechEncoderDecoder):
        return "speech_encoder_decoder"
    if isinstance(model, TransformerTTS):
        return "tts"
    if isinstance(model, Vits):
        return "vits"
    raise TypeError(f"not a qkv model: {type(model).__name__}")


def make_config(kind: str, fields: dict) -> Config:
    """The config of a model ``kind`` from its fields; unknown or bad fields are a UserError.

    A speech or TTS model's ``features`` field is the nested dict of its
    :class:`~qkv.audio.FeatureConfig` (how its frames are computed), checked like the rest.
    """
    if kind == "encoder_decoder":
        config_class = EncoderDecoderConfig
    elif kind == "encoder_only":
        config_class = EncoderOnlyConfig
    elif kind == "decoder_only":
        config_class = DecoderOnlyConfig
    elif kind == "speech_encoder_decoder":
        config_class = SpeechConfig
    elif kind == "tts":
        config_class = TTSConfig
    elif kind == "vits":
        config_class = VitsConfig
    else:
        raise UserError(f"unknown model kind {kind!r}; expected one of {', '.join(KINDS)}")
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(fields) - known)
    if unknown:
        named = ", ".join(n if n.isprintable() else repr(n) for n in unknown)  # a name with a line break, quoted
        raise UserError(f"unknown {kind} config field(s): {named}; known: {', '.join(sorted(known))}")
    try:
        config = config_class(**fields)
    except (TypeError, ValueError) as e:
        raise UserError(f"bad {kind} config: {e}") from None
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, int) and not isinstance(value, bool):
            limit = MAX_LAYERS if field.name.endswith("layers") else MAX_SIZE
            if not -MAX_SIZE <= value <= limit:
                raise UserError(f"bad {kind} config: {field.name}={value} is out of range (at most {limit:,})")
    return config


def build_model(kind: str, fields: dict) -> Model:
    """Build a freshly initialised model of ``kind`` from config fields; bad fields are a UserError,
    and so is a model whose weights would not fit in the memory available (counted first, on
    PyTorch's meta device, where nothing is allocated)."""
    need = sum(t.numel() * t.element_size() for t in state_once(skeleton(kind, fields)).values())
    available = available_memory()
    if available is not None and need > available:
        raise UserError(
            f"a {kind} model of this config needs {human_bytes(need)} for its weights alone; "
            f"{human_bytes(available)} of memory is available"
        )
    return _model_class(make_config(kind, fields))


def _model_class(config: Config) -> Model:
    if isinstance(config, EncoderDecoderConfig):
        return EncoderDecoder(config)
    if isinstance(config, EncoderOnlyConfig):
        return EncoderOnly(config)
    if isinstance(config, SpeechConfig):
        return SpeechEncoderDecoder(config)
    if isinstance(config, TTSConfig):
        return TransformerTTS(config)
    if isinstance(config, VitsConfig):
        return Vits(config)
    return DecoderOnly(config)


def skeleton(kind: str, fields: dict) -> Model:
    """The model of ``kind`` built on the meta device: its tensors have shapes and dtypes but no
    memory, so a config can be checked against a file, or counted, before anything is allocated.
    A config whose sizes PyTorch cannot even describe (an overflow) is a UserError."""
    config = make_config(kind, fields)
    try:
        with torch.device("meta"), _Unallocated():
            return _model_class(config)
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot build a {kind} model of this config: {reason}") from None


class _Unallocated(TorchFunctionMode):
    """Inside ``torch.device("meta")``: weight initialisation skipped (in-place ops on meta
    tensors change nothing, and some, like ``normal_``, would import the compiler, seconds),
    and ``torch.tensor`` of a value on the CPU (a model may compute a size from one)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is None:
            return func(*args, **{**kwargs, "device": "cpu"})
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("_") and name != "requires_grad_":
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def state_once(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each shared tensor (tied embeddings) once, under its first
    name, by identity (so also for meta tensors, which have no storage, and FSDP shards),
    detached: writing into a value writes into the model."""
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            state[name] = tensor.detach()
    return state


def check_output(directory: str | Path, *, models: bool = True) -> None:
    """Refuse (UserError) an output path that a save must not replace: anything but nothing, an
    empty directory or (with ``models``) an earlier qkv model directory; never the working
    directory or one above it, which the save would move away; nor one whose parent the
    process may not write in (the save makes it there). Call it before long work."""
    directory = Path(directory)
    check_writable(directory, inside=False)
    if not directory.exists():
        return
    resolved, cwd = directory.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise UserError(f"{directory} is the current directory or one above it; choose another output directory")
    if not _replaceable(directory, models=models):
        what = "a qkv model directory" if models else "an empty directory"
        raise UserError(f"{directory} exists and is not {what}; choose another output directory")


def _replaceable(directory: Path, *, models: bool) -> bool:
    """Only an empty directory or (with ``models``) an earlier qkv model directory may be
    replaced, or an unfinished run that trains into it (its checkpoint ``last/``: the run's
    final save replaces it)."""
    if not directory.is_dir():
        return False
    entries = {entry.name for entry in directory.iterdir()}
    if not entries:
        return True
    if not models:
        return False
    if all(RUN_ENTRY.fullmatch(name) for name in entries):
        # An unfinished run (RUN_ENTRY), or what a save killed midway left (atomic_directory's
        # temporaries, the shards of an FSDP save): the debris of a run killed during its first save
        return "last" not in entries or _replaceable(directory / "last", models=True)
    try:
        return read_json_object(directory / "config.json").get("kind") in KINDS  # never a link to /dev/zero read
    except UserError:
        return False


def save_model(
    model: Model,
    directory: str | Path,
    *,
    files: dict[str, Path] | None = None,
    extra: dict | None = None,
    moved: dict[str, tuple[Path, str]] | None = None,
    shards: int | None = None,
    carry: tuple[str, ...] = (),
) -> Path:
    """Write ``model`` (and copies of ``files``, keyed by their name in the directory) atomically.

    ``extra`` adds JSON fields to config.json (e.g. the task a demo model was trained on).
    ``moved``: files moved in (not copied: large ones, beside the directory on the same file
    system), each with its SHA-256 already known. ``shards``: the weights are not written here
    but are among the files, the pieces :func:`save_shards` wrote on that many workers (a
    sharded training checkpoint). ``carry``: entries of the directory being replaced that move
    into the new one as they are, not among its files (a training run's TensorBoard scalars).
    """
    if any(getattr(m, "w_qkv", None) is not None or getattr(m, "w_13", None) is not None for m in model.modules()):
        # decoding_copies.for_decoding's stacked projections: a decoding copy, not qkv's layout
        raise ValueError("a model prepared for decoding (for_decoding) cannot be saved; save the original")
    directory = Path(directory)
    check_output(directory)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {directory.parent}: {e.strerror}") from None
    with atomic_directory(directory) as tmp:
        if shards is None:
            state = {k: v.detach().contiguous().cpu() for k, v in state_once(model).items()}
            save_file(state, tmp / "model.safetensors")
        hashes = {}
        for name, source in (files or {}).items():
            shutil.copyfile(source, tmp / name)
            hashes[name] = sha256_file(tmp / name)
        for name, (source, digest) in (moved or {}).items():
            os.replace(source, tmp / name)
            hashes[name] = digest
        reserved = {"qkv_version", "kind", "config", "files", SHARDED}
        if reserved & set(extra or {}):
            raise ValueError(f"extra may not set {', '.join(sorted(reserved & set(extra)))}")
        meta = {
            "qkv_version": __version__,
            "kind": kind_of(model),
            "config": dataclasses.asdict(model.config),
            "files": hashes,
            **({SHARDED: shards} if shards is not None else {}),
            **(extra or {}),
        }
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        for name in carry:  # last: a failure before this leaves them where they were
            if (directory / name).exists() and name not in hashes:
                os.replace(directory / name, tmp / name)
    return directory


def model_dir(directory: str | Path) -> Path:
    """The model directory that ``directory`` names: itself, or for a training run directory
    (``runs.py``) the checkpoint its ``run.json`` calls final."""
    directory = Path(directory)
    if (directory / "config.json").is_file() or not (directory / RUN_FILE).is_file():
        return directory
    try:
        final = json.loads((directory / RUN_FILE).read_text(encoding="utf-8"))["final"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise UserError(f"{directory / RUN_FILE} names no final checkpoint; is the run finished?") from None
    if not isinstance(final, str) or not final or "/" in final or final.startswith("."):
        raise UserError(f"{directory / RUN_FILE}: 'final' must name a checkpoint directory of the run")
    return directory / final


def read_meta(directory: str | Path) -> dict:
    """Read and check ``config.json`` of a model directory or run (UserError on any problem)."""
    directory = model_dir(directory)
    if not directory.is_dir():
        raise UserError(f"model directory {directory} does not exist")
    path = directory / "config.json"
    if file_problem(path) == "is missing":
        raise UserError(f"{path} is missing: {directory} is not a qkv model directory")
    meta = read_json_object(path)  # a link to /dev/zero, a folder, a huge file: said as such
    for key in ("kind", "config"):
        if key not in meta:
            raise UserError(f"{path} has no {key!r} field")
    if not isinstance(meta["config"], dict):
        raise UserError(f"{path}: 'config' must be a JSON object")
    if not isinstance(meta["kind"], str) or meta["kind"] not in KINDS:
        raise UserError(f"{path}: 'kind' is {meta['kind']!r}; qkv knows {', '.join(KINDS)}")
    files = meta.setdefault("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise UserError(f"{path}: 'files' must map file names to SHA-256 strings")
    for name, digest in files.items():
        file = directory / name
        if not name or name != Path(name).name or name in (".", ".."):
            raise UserError(f"{path}: 'files' may list only file names inside {directory}, not {name!r}")
        problem = file_problem(file)
        if problem is not None:
            raise UserError(f"{file} {problem} (listed in {path})")
        if is_pickle(file):
            raise UserError(f"{file} (listed in {path}) is a pickle; qkv never unpickles, so it refuses the directory")
        if sha256_file(file) != digest:
            raise UserError(f"{file} does not match the SHA-256 recorded in {path}; it was changed or replaced")
    return meta


def load_model(directory: str | Path, *, kind: str | None = None, meta: dict | None = None) -> tuple[Model, dict]:
    """Load a model directory; returns the model (in eval mode) and its config.json contents.

    ``kind`` refuses a model of another kind. ``meta``: the directory's config.json as
    :func:`read_meta` gave it, where the caller has read it already (it hashes every listed
    file, so it is read once). Nothing is unpickled: weights come from
    safetensors. Before anything is allocated, the file's header (names, shapes, dtypes) is
    checked against the model the config describes, built on the meta device, so a config
    or a file that disagrees, however large the sizes it claims, is refused without trying;
    then the weights are read and must be finite floating-point numbers.
    """
    directory = model_dir(directory)
    meta = read_meta(directory) if meta is None else meta
    if kind is not None and meta["kind"] != kind:
        raise UserError(f"{directory} holds a {meta['kind']} model; this needs a {kind} model")
    config_path = directory / "config.json"
    sharded = meta.get(SHARDED) is not None
    weights = directory / ("model.safetensors" if not sharded else "shard-*.safetensors")
    if sharded:
        stored = {name[len(WEIGHTS) :]: v for name, v in shard_index(directory).items() if name.startswith(WEIGHTS)}
    else:
        problem = file_problem(weights)
        if problem is not None:
            raise UserError(f"{weights} {problem}")
        if is_pickle(weights):
            raise UserError(f"{weights} is a pickle, not safetensors; qkv never unpickles, so it refuses the file")
        stored = _header(weights)
    try:
        config = make_config(meta["kind"], meta["config"])
        layers = sum(getattr(config, f.name) for f in dataclasses.fields(config) if f.name.endswith("layers"))
        if layers > len(stored):  # every layer has weights: a config that claims more is not this file's
            raise UserError(f"{layers} layers, but {weights.name} holds {len(stored)} tensors in all")
        expected = {name: tuple(t.shape) for name, t in state_once(skeleton(meta["kind"], meta["config"])).items()}
    except UserError as e:
        raise UserError(f"{config_path}: {e}") from None
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        parts = [
            f"missing {', '.join(missing[:5])}" if missing else "",
            f"unexpected {', '.join(unexpected[:5])}" if unexpected else "",
        ]
        raise UserError(f"{weights} does not match its config: {'; '.join(p for p in parts if p)}")
    for name, shape in expected.items():
        dtype, found = stored[name]
        if found != shape:
            raise UserError(f"{weights}: tensor {name} has shape {found}, the config needs {shape}")
        if not dtype.startswith(("F", "BF")):
            raise UserError(f"{weights}: tensor {name} holds {dtype} values; weights are floating-point numbers")
    try:
        model = build_model(meta["kind"], meta["config"])
    except UserError as e:
        raise UserError(f"{config_path}: {e}") from None
    if sharded:
        tensors = {name: torch.empty(shape, dtype=DTYPES[dtype]) for name, (dtype, shape) in stored.items()}
        # (every weight's dtype was checked above to be a floating-point one DTYPES names)
        read_shards(directory, {WEIGHTS + name: t for name, t in tensors.items()})
    else:
        try:
            tensors = load_file(weights)
        except BaseException as e:  # the library's Rust panics are BaseExceptions
            if not _library_error(e):
                raise
            raise UserError(f"{weights} cannot be read as safetensors: {_first_line(e)}") from None
    with torch.no_grad():
        for name, target in state_once(model).items():
            if not bool(torch.isfinite(tensors[name]).all()):
                raise UserError(f"{weights}: tensor {name} holds NaN or infinite values (a damaged file?)")
            target.copy_(tensors[name])
    return model.eval(), meta


def save_shards(state: dict[str, torch.Tensor], directory: Path) -> None:
    """Write ``state`` (whole tensors or FSDP shards: DTensors) into the empty ``directory`` with
    ``torch.distributed.checkpoint``: collective, every worker writes its own pieces in parallel
    (one safetensors file each, a replicated tensor once). A checkpoint of N workers loads on any
    number of workers, sharded or not (:func:`read_shards`). With several machines ``directory``
    must be on a file system they share."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    group = dist.is_available() and dist.is_initialized()
    writer = dcp.HuggingFaceStorageWriter(str(directory), save_distributed=group)
    try:
        dcp.save(state, storage_writer=writer, no_dist=not group)
    except (OSError, RuntimeError) as e:  # a worker's write failed: DCP's CheckpointException holds why
        errno = next((n for n in map(storage_errno, [e, *_causes(e)]) if n is not None), None)
        if errno is None:
            raise
        raise UserError(f"cannot write the checkpoint's shards in {directory}: {os.strerror(errno)}") from None


def shard_index(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, whole shape)} of the tensors :func:`save_shards` wrote in ``directory``,
    from the files' headers alone (dtype as safetensors names it: ``F32``, ``U8``...)."""
    import torch.distributed.checkpoint as dcp

    for file in sorted(directory.glob("shard-*.safetensors")):
        _header(file)  # a damaged or foreign file is refused by name, before the reader sees it
    try:
        metadata = dcp.HuggingFaceStorageReader(str(directory)).read_metadata()
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"{directory}: cannot read the sharded weights: {_first_line(e)}") from None
    names = {dtype: name for name, dtype in DTYPES.items()}
    out = {}
    for name, entry in metadata.state_dict_metadata.items():
        dtype = names.get(getattr(getattr(entry, "properties", None), "dtype", None), "?")
        out[name] = (dtype, tuple(getattr(entry, "size", ())))
    return out


def read_shards(directory: Path, template: dict[str, torch.Tensor]) -> None:
    """Fill ``template``'s tensors (whole, or this worker's FSDP shards) from :func:`save_shards`'s
    files in ``directory``, whatever number of workers wrote them; keys absent from ``template``
    are not read. Collective when a process group exists."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    group = dist.is_available() and dist.is_initialized()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # without a group it says it assumes one process: it is one
            dcp.load(
                template,
                storage_reader=dcp.HuggingFaceStorageReader(str(directory)),
                planner=dcp.DefaultLoadPlanner(allow_partial_load=True),
                no_dist=not group,
            )
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # CheckpointException is a RuntimeError
        raise UserError(f"{directory}: cannot read the sharded weights: {_first_line(e)}") from None


def _causes(error: BaseException) -> list[BaseException]:
    """The exceptions inside ``error``: its causes and contexts, and the per-worker failures a
    ``torch.distributed.checkpoint.CheckpointException`` holds."""
    found, todo = [], [error]
    while todo:
        e = todo.pop()
        failed = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]  # (error, stack)
        for inner in (e.__cause__, e.__context__, *failed):
            if isinstance(inner, BaseException) and inner not in found:
                found.append(inner)
                todo.append(inner)
    return found


def is_pickle(path: Path) -> bool:
    """Whether ``path`` starts as a pickle does (protocol 2 and later: 0x80, the protocol) or as
    a ``torch.save`` file (a zip archive holding one). Only the first bytes are read."""
    try:
        with open(path, "rb") as f:
            start = f.read(4)
    except OSError:
        return False
    return (len(start) >= 2 and start[0] == 0x80 and 2 <= start[1] <= 5) or start == b"PK\x03\x04"


def _header(weights: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a safetensors file, read from its header alone (UserError when
    the file is not safetensors: a pickle, a truncated file, a header that does not add up)."""
    try:
        with safe_open(weights, framework="pt") as f:
            return {name: (f.get_slice(name).get_dtype(), tuple(f.get_slice(name).get_shape())) for name in f.keys()}
    except BaseException as e:  # the library's Rust panics are BaseExceptions
        if not _library_error(e):
            raise
        raise UserError(f"{weights} cannot be read as safetensors: {_first_line(e)}") from None


def _library_error(error: BaseException) -> bool:
    """Whether ``error`` is the safetensors library refusing a file: its own errors, an
    OSError, or a Rust panic (pyo3's PanicException, a BaseException of its own)."""
    return isinstance(error, (SafetensorError, OSError, ValueError)) or type(error).__name__ == "PanicException"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
