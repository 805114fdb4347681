"""``qkv import-hf`` and ``qkv export-hf``: Hugging Face checkpoints in and out.

What is here: the command's arguments (``add_parser``) beside its handler.
"""

from __future__ import annotations

import argparse
import json
import sys

EPILOG_IMPORT_HF = """examples:
  qkv import-hf ~/hf/gpt2 models/gpt2 && qkv generate --model models/gpt2 --prompt "Hello"
  qkv import-hf ~/hf/SmolLM2-135M-Instruct models/smollm2 && qkv chat --model models/smollm2
  qkv import-hf ~/hf/bert-base-uncased models/bert --json
  qkv import-hf en_US-joe-medium.onnx voices/joe && qkv speak --model voices/joe --text "Hi." --output hi.wav
"""


EPILOG_IMPORT_GGUF = """examples:
  qkv import-gguf ~/models/SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2 && qkv chat --model models/smollm2
  qkv import-gguf ~/models/qwen2.5-0.5b-instruct-q8_0.gguf models/qwen --json
"""


EPILOG_EXPORT_HF = """example:
  qkv export-hf models/gpt2 hf/gpt2     # then transformers: AutoModelForCausalLM.from_pretrained("hf/gpt2")
"""


def cmd_import_hf(args: argparse.Namespace) -> int:
    from qkv.hf.convert import import_hf

    if str(args.src).endswith(".onnx"):
        return _import_piper(args)
    result = import_hf(args.src, args.dst)
    if result["ignored"]:  # tensors the model does not use (BERT's next-sentence head, an unused pooler)
        names = result["ignored"]
        print(
            f"qkv import-hf: note: {len(names)} tensor(s) of {args.src} not used: {', '.join(names)}", file=sys.stderr
        )
    for note in result["notes"]:  # tokenizer settings not kept, sentence-transformers modules not reproduced
        print(f"qkv import-hf: note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"imported {result['architecture']} as a {result['kind']} model ({result['parameters']} parameters) "
            f"into {result['model']}; tokenizer: {result['tokenizer']}"
        )
        embedding = result["embedding"]
        if embedding is not None:  # what qkv embed uses by default
            said = ", ".join(f"{k} {v}" for k, v in embedding.items() if k != "source")
            print(f"embedding defaults for qkv embed: {said} ({embedding.get('source')})")
    return 0


def _import_piper(args: argparse.Namespace) -> int:
    """A Piper voice (VOICE.onnx and VOICE.onnx.json) into a qkv VITS model directory."""
    from qkv.hf.piper import import_piper

    result = import_piper(args.src, args.dst)
    if args.json:
        print(json.dumps(result))
    else:
        speakers = f"{result['speakers']} speakers" if result["speakers"] > 1 else "one speaker"
        print(
            f"imported the Piper voice {args.src} as a vits model ({result['parameters']} parameters, "
            f"{result['sample_rate']} Hz, {speakers}) into {result['model']}; "
            f"speak with qkv speak --model {result['model']}"
        )
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from qkv.hf.convert import export_hf

    result = export_hf(args.src, args.dst)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"exported as {result['architecture']} into {result['out']}: {', '.join(result['files'])}")
    return 0


def add_import_parser(sub: argparse._SubParsersAction) -> None:
    """The ``import-hf`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "import-hf",
        help="convert a local Hugging Face checkpoint (BERT, RoBERTa, DistilBERT, GPT-2, Llama, Qwen2, Mistral, "
        "Gemma 3, Marian, Whisper) into a qkv model",
        description="Read a Hugging Face checkpoint directory (config.json + model.safetensors or "
        "pytorch_model.bin, and its tokenizer files) of BertModel, BertForMaskedLM, "
        "BertForSequenceClassification, RobertaModel, RobertaForMaskedLM, RobertaForSequenceClassification "
        "(and XLMRoberta*), DistilBertModel, DistilBertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM, "
        "Qwen2ForCausalLM, MistralForCausalLM, Gemma3ForCausalLM, MarianMTModel or "
        "WhisperForConditionalGeneration (weights whole or in shards: model.safetensors.index.json) and write "
        "a qkv model directory "
        "that computes the same outputs. Nothing is downloaded. Marian's SentencePiece files are converted "
        "(shared vocabulary) and kept for export; a Whisper's start tokens (languages, tasks) are recorded for "
        "qkv transcribe --language/--task; tensors the model does not use are named on stderr. "
        "A sentence-transformers directory (modules.json) is read too: its pooling, Normalize module and "
        "max_seq_length are recorded for qkv embed. A tokenizer.json's padding and truncation are not kept: "
        "qkv pads, masks and cuts to the window itself. A Llama-family checkpoint's tokenizer settings, "
        "generation_config.json and chat template are kept for qkv chat and export. Other families (MPNet, "
        "DeBERTa, T5, Phi, ...) are refused, naming the architectures qkv reads. RoBERTa and DistilBERT export "
        "back as BERT. A Piper voice (VOICE.onnx with VOICE.onnx.json beside it) is read too: its VITS weights "
        "from the ONNX initializers (the onnx package), its phoneme map and speakers from the .onnx.json.",
        epilog=EPILOG_IMPORT_HF,
        formatter_class=raw,
    )
    p.add_argument(
        "src",
        help="Hugging Face checkpoint directory (what save_pretrained writes), a .gguf file or a Piper VOICE.onnx",
    )
    p.add_argument("dst", help="qkv model directory to write")
    p.add_argument("--json", action="store_true", help="print a summary as one JSON line")
    p.set_defaults(run=cmd_import_hf)


def add_import_gguf_parser(sub: argparse._SubParsersAction) -> None:
    """The ``import-gguf`` command's arguments (``import-hf`` reads a ``.gguf`` file too)."""
    p = sub.add_parser(
        "import-gguf",
        help="convert a GGUF file (llama.cpp's: Llama, SmolLM, Qwen2, Mistral, Gemma 3) into a qkv model",
        description="Read a GGUF file with the gguf package (llama.cpp's reader): the architecture and its "
        "hyper-parameters, every tensor dequantised to float32 (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
        "Q2_K to Q6_K), the tokenizer from its metadata (vocabulary, merges, special tokens) and its chat template, "
        "and write a qkv model directory that computes what the file's model computes. Nothing is downloaded.",
        epilog=EPILOG_IMPORT_GGUF,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", help="a .gguf file")
    p.add_argument("dst", help="qkv model directory to write")
    p.add_argument("--json", action="store_true", help="print a summary as one JSON line")
    p.set_defaults(run=cmd_import_gguf)


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from pathlib import Path

    from qkv.errors import UserError

    if Path(args.src).suffix != ".gguf":
        raise UserError(f"{args.src} is not a .gguf file; qkv import-hf reads checkpoint directories")
    return cmd_import_hf(args)


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """The ``export-hf`` command's arguments."""
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser(
        "export-hf",
        help="write a qkv model directory as a Hugging Face checkpoint (BERT, GPT-2, Llama family, Marian, Whisper)",
        description="Write a qkv model whose architecture is BERT's (encoder_only), GPT-2's or a Llama family's "
        "(decoder_only: RoPE models as the Llama, Qwen2, Mistral or Gemma 3 they were imported as, else as "
        "Llama), Marian's (encoder_decoder) or Whisper's (speech_encoder_decoder) as a directory that transformers "
        "loads with from_pretrained: config.json, "
        "model.safetensors and the tokenizer files. A model those architectures cannot express is refused, "
        "naming the config field.",
        epilog=EPILOG_EXPORT_HF,
        formatter_class=raw,
    )
    p.add_argument("src", help="qkv model directory or training run")
    p.add_argument("dst", help="output directory (must not exist, or be an empty directory other than the current one)")
    p.add_argument("--json", action="store_true", help="print a summary as one JSON line")
    p.set_defaults(run=cmd_export_hf)
