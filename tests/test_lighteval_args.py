"""The lighteval model's arguments are checked before anything loads, in the same one-line words as the lm-eval
backend and the command line give for the same values (bridgelm.integrations.lighteval_args imports no lighteval, so
these run where lighteval is not installed)."""

import pytest

from bridgelm.errors import UserError
from bridgelm.integrations.lighteval_args import OWNER, parse_model_args, sampling_args


def _refusal(text: str) -> str:
    with pytest.raises(UserError) as err:
        sampling_args(parse_model_args("pretrained=DIR," + text))
    message = str(err.value)
    assert message.startswith(f"{OWNER}: ") and "\n" not in message
    return message[len(OWNER) + 2 :]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("width=0", "width=0: expected a positive integer"),
        ("width=1.5", "width=1.5: expected a positive integer"),  # refused, not truncated, as in lm-eval
        ("max_new_tokens=0", "max_new_tokens=0: expected a positive integer"),
        ("seed=abc", "seed='abc': expected an integer >= 0"),
        ("seed=-1", "seed=-1: expected an integer >= 0"),  # was refused only at the first batch
        ("temperature=nan", "temperature=nan: expected a finite number"),  # was accepted (float('nan'))
        ("temperature=inf", "temperature=inf: expected a finite number"),
        ("temperature=-1", "temperature=-1.0: expected a finite number >= 0 (0 = greedy)"),  # was accepted
        ("top_p=2", "top_p=2.0: expected a finite number in (0, 1]"),  # was accepted
        ("top_k=-1", "top_k=-1: expected an integer >= 0 (0 = off)"),  # was accepted
        ("top_k=1.5", "top_k=1.5: expected an integer"),
    ],
)
def test_sampling_arguments_are_refused_in_the_lm_eval_backends_words(text, expected):
    assert _refusal(text) == expected


@pytest.mark.parametrize("name, value", [("width", 0), ("width", 1.5), ("seed", "abc"), ("max_new_tokens", 0)])
def test_the_same_value_reads_the_same_in_both_integrations(name, value):
    """lm-eval hands its backend typed values (1.5, 'abc'); lighteval's model name holds text: both say the same."""
    pytest.importorskip("lm_eval")
    from bridgelm.integrations.lm_eval import BridgeLM

    with pytest.raises(UserError) as err:
        BridgeLM(pretrained="DIR", **{name: value})  # refused before any model loads
    lm_eval_words = str(err.value).split(": ", 1)[1]
    assert _refusal(f"{name}={value}") == lm_eval_words


def test_a_repeated_argument_is_refused_not_overwritten():
    with pytest.raises(UserError, match="model argument width is given twice: expected each once"):
        parse_model_args("pretrained=DIR,width=4,width=2")


def test_good_arguments_are_typed():
    got = sampling_args(parse_model_args("pretrained=DIR,width=2,seed=3,temperature=0.7,top_p=0.9,top_k=5"))
    assert got == {"width": 2, "seed": 3, "max_new_tokens": None, "temperature": 0.7, "top_p": 0.9, "top_k": 5}
    default = sampling_args(parse_model_args("pretrained=DIR"))
    assert default["temperature"] is None and default["max_new_tokens"] is None  # by the documents, by the task
    assert sampling_args(parse_model_args("pretrained=DIR,max_new_tokens=7"))["max_new_tokens"] == 7
    with pytest.raises(UserError, match="seed=-1: expected an integer >= 0"):  # before the model loads (was: after)
        sampling_args(parse_model_args("pretrained=DIR,seed=-1"))


def test_the_system_prompt_comes_last_and_keeps_its_commas():
    args = parse_model_args("pretrained=DIR,width=2,system_prompt=Think first, then answer, with a number.")
    assert args == {"pretrained": "DIR", "width": "2", "system_prompt": "Think first, then answer, with a number."}
    assert parse_model_args("pretrained=DIR")  # no system prompt: none
    with pytest.raises(UserError, match="model argument width is given twice"):  # what comes before is still checked
        parse_model_args("pretrained=DIR,width=2,width=3,system_prompt=a, b")
