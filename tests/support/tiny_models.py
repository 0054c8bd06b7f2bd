"""Tiny random-weight checkpoints in HF format, with a real byte-level BPE tokenizer trained offline.

They load in milliseconds, exercise the same code paths as a real model (GQA, RoPE, tied or untied
embeddings, Qwen3's q/k norms) and ``transformers`` serves as the reference for them.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = textwrap.dedent(
    """
    The quick brown fox jumps over the lazy dog. Paris is the capital of France.
    Berlin is the capital of Germany. Rome is the capital of Italy. Madrid is in Spain.
    A language model predicts the next token from the tokens before it. Attention reads
    keys and values from a cache, and a paged cache stores them in fixed-size blocks.
    Continuous batching adds new requests to a running batch at every step of the engine.
    Kubernetes runs pods on nodes; an operator reconciles custom resources into objects.
    What is the capital of France? Tell me a story about a cat who lived in a library.
    0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 hello world system user assistant
    """
)


def train_tokenizer(vocab_size: int = 384) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer


def _write_tokenizer(folder: Path, tokenizer: Tokenizer) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 2048,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_tiny_model(folder: Path, arch: str = "llama", *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a tiny random ``arch`` ('llama' or 'qwen3') checkpoint into ``folder``; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    eos_id = tokenizer.token_to_id("<|im_end|>")
    common = {
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
    }
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
    elif arch == "qwen3":
        config = Qwen3Config(**common, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(config)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}: use 'llama' or 'qwen3'")
    # Random init gives near-uniform logits; scale up so greedy choices are well separated.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.mul_(4.0)
    model.to(getattr(torch, dtype)).save_pretrained(folder, safe_serialization=True)
    _write_tokenizer(folder, tokenizer)
    return folder


BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _bert_tokenizer(vocab_size: int = 384) -> Tokenizer:
    """A WordPiece tokenizer as BERT's: lower-cased, ``[CLS] text [SEP]``."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=BERT_SPECIAL_TOKENS, show_progress=False
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tokenizer


def make_tiny_bert(
    folder: Path,
    *,
    pooling: str = "mean",
    normalize: bool = True,
    matryoshka_dimensions: list[int] | None = None,
    max_seq_length: int | None = 64,
    seed: int = 0,
) -> Path:
    """A tiny random ``BertModel`` as a sentence-transformers folder: ``pooling`` ('mean', 'cls',
    'lasttoken'), a ``Normalize`` module when ``normalize``; ``matryoshka_dimensions`` declared in
    its config.json (vLLM's key) when given."""
    import torch
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _bert_tokenizer()
    config = BertConfig(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    if matryoshka_dimensions is not None:
        config.matryoshka_dimensions = matryoshka_dimensions
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "BertTokenizerFast",
        "do_lower_case": True,
        "model_max_length": 128,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {
        "mean": "pooling_mode_mean_tokens",
        "cls": "pooling_mode_cls_token",
        "lasttoken": "pooling_mode_lasttoken",
    }
    pooling_config = {
        "word_embedding_dimension": 64,
        **{key: key == modes[pooling] for key in modes.values()},
    }
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return folder
