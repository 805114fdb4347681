"""Hugging Face checkpoints in and out of qkv (``qkv import-hf``, ``qkv export-hf``), one module per family.

    common.py    what the families share: config.json and weight files read, tensor names
                 matched and checked, tokenizer settings read
    bert.py      BERT (BertModel, BertForMaskedLM, BertForSequenceClassification) <-> encoder_only
    roberta.py   RoBERTa and XLM-RoBERTa (Model, ForMaskedLM, ForSequenceClassification) -> encoder_only
    distilbert.py  DistilBERT (DistilBertModel, DistilBertForMaskedLM) -> encoder_only
    gpt2.py      GPT-2 (GPT2LMHeadModel) <-> decoder_only
    llama.py     the Llama family (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM,
                 Gemma3ForCausalLM) <-> decoder_only: RoPE and its scalings, sliding windows,
                 Gemma's norms; its tokenizer, and the files chat and export keep
    gguf.py      GGUF files (llama.cpp's): metadata, tensors and tokenizer read with the gguf
                 package into what a Llama-family checkpoint directory would hold
    marian.py    Marian (MarianMTModel) <-> encoder_decoder, and MarianTokenizer's files
    whisper.py   Whisper (WhisperForConditionalGeneration) <-> speech_encoder_decoder, its
                 features, tokenizer and the decoder's start tokens (language, task)
    sentence_transformers.py
                 a sentence-transformers directory's pipeline (modules.json: pooling,
                 Normalize; sentence_bert_config.json) and the window a checkpoint's users get
    convert.py   import_hf, export_hf, classifier_labels: the choice of family and the steps all share

A family module imports common.py (and a family it builds on: roberta.py reads BERT's layers and
GPT-2's BPE files), never convert.py, and holds: the tuple of HF classes
it reads (``BERT``), ``<family>_fields`` (config.json -> qkv config fields), ``<family>_to_qkv``
/ ``qkv_to_<family>`` (weight names), ``<family>_config`` (qkv config -> config.json) and its
tokenizer conversion. To add a family (say ``t5.py``): write such a module, add its tuple
to ``convert.SUPPORTED``, and give it a branch wherever ``convert.import_hf`` and
``convert.export_hf`` choose by architecture or by config class (``else`` there means Marian);
and see :func:`~qkv.hf.common.read_from` and :func:`~qkv.hf.common.untied_copies`, which know
each family's second names of tied weights.

This file imports nothing: ``from qkv.hf.convert import import_hf``. ``transformers`` is never
imported.
"""
