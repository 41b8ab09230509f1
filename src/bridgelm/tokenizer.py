"""Tokenizers built on the spot with the `tokenizers` package, for the demo and the tests (no download).

`char_tokenizer` maps every character of an alphabet to one id; `train_bpe` learns a byte-level BPE from
texts. Both return a `transformers.PreTrainedTokenizerFast` with pad/bos/eos tokens and a small chat
template, so every later stage loads them like any Hugging Face tokenizer (`save_pretrained`).

`load_tokenizer` is how bridgelm loads every tokenizer (AutoTokenizer, except that a folder saved from a generic
fast tokenizer, as these are, loads as exactly that: see its docstring).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from bridgelm.errors import UserError
from bridgelm.jsonl import read_json_object

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
SPECIALS = [PAD, BOS, EOS, USER, ASSISTANT]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% else %}" + ASSISTANT + "{{ m['content'] }}" + EOS + "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def _wrap(tok: Tokenizer, add_bos: bool) -> PreTrainedTokenizerFast:
    if add_bos:
        bos_id = tok.token_to_id(BOS)
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, additional_special_tokens=[USER, ASSISTANT]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def char_tokenizer(alphabet: str, add_bos: bool = False) -> PreTrainedTokenizerFast:
    """One id per character of `alphabet` (after the special tokens 0..4: pad, bos, eos, user, assistant)."""
    chars = sorted(set(alphabet))
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return _wrap(tok, add_bos)


def train_bpe(texts: Iterable[str], vocab_size: int = 512, add_bos: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` ids learned from `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return _wrap(tok, add_bos)


# What a generic fast tokenizer (ours, or any built from a `tokenizers.Tokenizer`) writes as its class when saved.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


# The files a tokenizer is read from (one suffices): fast, config, byte-level BPE, SentencePiece and WordPiece ones.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.txt",
)


def unknown_characters(tokenizer, text: str, ids: Sequence[int] | None = None) -> list[str]:
    """The characters of `text` (distinct, in order) that `tokenizer` can only encode as its unknown token: a
    character vocabulary maps them to `<pad>`, so the model would not see them. `ids`, the text's encoding when at
    hand, skips the second encoding when it holds no unknown token. Tokenizers without one (byte-level BPE): []."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    unk = getattr(getattr(backend, "model", None), "unk_token", None)
    if not unk:
        return []
    unk_id = backend.token_to_id(unk)
    if ids is not None and unk_id not in ids:
        return []
    found = []
    encoding = backend.encode(text, add_special_tokens=False)
    for token, (start, end) in zip(encoding.ids, encoding.offsets):
        piece = text[start:end]
        if token == unk_id and piece != unk and piece not in found:  # not the token written out
            found.append(piece)
    return found


def check_vocab(model, tokenizer, name: str | os.PathLike) -> None:
    """UserError naming both sizes when the tokenizer has more tokens than the model has embedding rows: its larger
    ids would index past the embedding (an IndexError mid-run). A model with more rows than tokens is fine (padded)."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise UserError(
            f"model {name}: its tokenizer has {len(tokenizer)} tokens but the model's vocabulary only {rows} "
            "(vocab_size): expected a tokenizer that fits the model (the one saved with it)"
        )


def load_tokenizer(name_or_path: str | os.PathLike, **kwargs):
    """The tokenizer of a model folder or hub id, as `AutoTokenizer.from_pretrained` gives it, except for a local
    folder (or its `subfolder=`) whose `tokenizer_config.json` names a generic class: that one loads as
    `PreTrainedTokenizerFast`, from its `tokenizer.json` as written. (transformers 5's AutoTokenizer would take the
    class of the folder's model type instead, Qwen2Tokenizer for a qwen2 `config.json`, which puts Qwen's
    pre-tokenizer in front of the vocabulary: a character vocabulary then drops "\n" when it encodes.) Hub ids go
    to AutoTokenizer as they are."""
    folder = Path(name_or_path) / kwargs.get("subfolder", "")
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        # AutoTokenizer would build an empty vocabulary from config.json alone and every prompt would encode to []
        raise UserError(
            f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): expected the tokenizer "
            "saved with the model (tokenizer.save_pretrained into the same folder)"
        )
    config = folder / "tokenizer_config.json"
    if config.is_file() and (folder / "tokenizer.json").is_file():
        if read_json_object(config, "a tokenizer config").get("tokenizer_class") in GENERIC_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(name_or_path, **kwargs)
    # a tokenizer folder's own code (auto_map) is never run, and transformers never asks whether to
    return AutoTokenizer.from_pretrained(name_or_path, **{"trust_remote_code": False, **kwargs})
