"""Tokenizers saved by bridgelm reload as written (`bridgelm.tokenizer.load_tokenizer`), also beside a model
config whose type has a tokenizer class of its own."""

import json
import warnings

import pytest
from conftest import save_tiny_model_dir
from transformers import AutoTokenizer

from bridgelm.errors import DataWarning
from bridgelm.source import ModelSource
from bridgelm.engine import encode_prompts
from bridgelm.tokenizer import char_tokenizer, load_tokenizer, train_bpe, unknown_characters

TEXT = "12+(3-4)\n= abc\n\n0"


def test_a_saved_character_tokenizer_keeps_newlines(tmp_path):
    """A qwen2 model folder with a character tokenizer (as the demo saves): the same ids as before saving, "\\n"
    included, the same specials and chat template. AutoTokenizer alone loads Qwen2Tokenizer, which drops "\\n"."""
    folder = tmp_path / "m"
    _, want = save_tiny_model_dir(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    for tok in (load_tokenizer(folder), ModelSource(str(folder)).load_tokenizer()):
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


def test_characters_a_vocabulary_lacks_are_named():
    """A character vocabulary encodes what it lacks as <pad>: `unknown_characters` names those characters (once
    each, in order), and encode_prompts warns once, counting the prompts and naming the first one's characters.
    "<pad>" written out, and tokenizers without an unknown token (byte-level BPE), are not flagged."""
    tok = char_tokenizer("0123456789+=")
    assert tok("1+W")["input_ids"][-1] == tok.pad_token_id  # what it reads
    assert unknown_characters(tok, "What 1+2=<pad>?") == ["W", "h", "a", "t", " ", "?"]
    assert unknown_characters(tok, "1+2=<pad>") == []
    assert unknown_characters(tok, "1+W", ids=tok("1+2")["input_ids"]) == []  # ids without the unknown id: no check
    assert unknown_characters(train_bpe(["1+2=3"], vocab_size=300), "What?") == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert encode_prompts(tok, ["1+2="]) == [tok("1+2=")["input_ids"]]
    for chat in (False, True):
        with pytest.warns(DataWarning) as caught:
            ids = encode_prompts(tok, ["1+2=", "1+x=?", "y"], chat=chat)
        assert len(caught) == 1 and ids[1][-3 if not chat else -4] == tok.pad_token_id
        assert str(caught[0].message) == (
            "2 of 3 prompts hold characters the tokenizer has no token for (prompt 1: 'x', '?'); the model reads each "
            "as '<pad>'"
        )
