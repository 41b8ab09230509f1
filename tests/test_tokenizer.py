"""Tokenizers saved by bridgelm reload as written (`bridgelm.tokenizer.load_tokenizer`), also beside a model
config whose type has a tokenizer class of its own."""

import json

from conftest import save_tiny_model_dir
from transformers import AutoTokenizer

from bridgelm.cli.common import load_tokenizer as cli_load_tokenizer
from bridgelm.tokenizer import load_tokenizer, train_bpe

TEXT = "12+(3-4)\n= abc\n\n0"


def test_a_saved_character_tokenizer_keeps_newlines(tmp_path):
    """A qwen2 model folder with a character tokenizer (as the demo saves): the same ids as before saving, "\\n"
    included, the same specials and chat template. AutoTokenizer alone loads Qwen2Tokenizer, which drops "\\n"."""
    folder = tmp_path / "m"
    _, want = save_tiny_model_dir(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    for tok in (load_tokenizer(folder), cli_load_tokenizer(str(folder))):
        assert tok(TEXT)["input_ids"] == want(TEXT)["input_ids"]
        assert tok.decode(tok(TEXT)["input_ids"]) == TEXT
        assert tok.all_special_tokens == want.all_special_tokens and tok.chat_template == want.chat_template
    assert AutoTokenizer.from_pretrained(folder)(TEXT)["input_ids"] != want(TEXT)["input_ids"]  # the trap


def test_a_saved_bpe_round_trips_and_named_classes_load_as_themselves(tmp_path):
    folder = tmp_path / "m"
    save_tiny_model_dir(folder)
    bpe = train_bpe(["12+34=46\nab c", "abc\n\n1-2"] * 20, vocab_size=300)
    bpe.save_pretrained(folder)  # beside the qwen2 config.json, in place of the character tokenizer
    assert load_tokenizer(folder)(TEXT)["input_ids"] == bpe(TEXT)["input_ids"]
    assert AutoTokenizer.from_pretrained(folder)(TEXT)["input_ids"] != bpe(TEXT)["input_ids"]
    assert load_tokenizer(tmp_path, subfolder="m")(TEXT)["input_ids"] == bpe(TEXT)["input_ids"]
    AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path / "qwen")  # saved as Qwen2Tokenizer
    assert type(load_tokenizer(tmp_path / "qwen")).__name__ == "Qwen2Tokenizer"
