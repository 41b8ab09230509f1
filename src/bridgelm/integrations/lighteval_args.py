"""The lighteval model's arguments, read from the model name lighteval hands it ("pretrained=DIR,width=4,...") and
checked before anything loads, in the one-line words of the lm-eval backend and the command line for the same values
(loading.positive_int, integer, number; the engine's sampling checks). It imports no lighteval, so it is tested
where lighteval is not installed."""

from __future__ import annotations

import re

from bridgelm.engine.config import check_sampling
from bridgelm.errors import UserError, check_int
from bridgelm.integrations.loading import integer, number, positive_int, seed_arg

OWNER = "bridgelm lighteval model"  # how errors name this model
DEFAULT_NEW_TOKENS = 256  # a sample's new tokens where neither max_new_tokens nor the task gives them
ARGUMENTS = ("pretrained", "blocks", "width", "seed", "dtype", "device", "max_new_tokens", "temperature", "top_p",
             "top_k", "chat", "system_prompt")


def parse_model_args(text: str) -> dict[str, str]:
    """"pretrained=DIR,width=4" -> {"pretrained": "DIR", "width": "4"}; unknown or repeated keys are refused.
    system_prompt comes last and takes the rest of the text, commas included."""
    args = {}
    prompt = re.search(r"(?:^|,)\s*system_prompt=", text)
    if prompt:
        text, args["system_prompt"] = text[: prompt.start()], text[prompt.end():].strip()
        _refuse_arguments_in(args["system_prompt"])
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise UserError(f"{OWNER}: model argument {part!r}: expected key=value (e.g. pretrained=DIR,width=4)")
        if key.strip() in args:
            raise UserError(f"{OWNER}: model argument {key.strip()} is given twice: expected each once")
        args[key.strip()] = value.strip()
    unknown = sorted(set(args) - set(ARGUMENTS))
    if unknown:
        raise UserError(f"{OWNER}: unknown model argument(s) {', '.join(unknown)}: expected {', '.join(ARGUMENTS)}")
    if "pretrained" not in args:
        raise UserError(f"{OWNER}: model arguments {text!r} name no model: expected pretrained=DIR (or a hub id)")
    if args.get("chat", "0") not in ("0", "1"):
        raise UserError(f"{OWNER}: chat={args['chat']!r}: expected 0 or 1")
    return args


def _refuse_arguments_in(prompt: str) -> None:
    """UserError where the system prompt ends in model arguments (`...,width=4,temperature=0.6`): arguments given after
    it, which would be read as its text and their settings lost. A prompt that merely holds "width=3" in its words
    passes: only a tail of known key=value parts to its end reads as misplaced arguments."""
    first = re.search(rf",\s*(?:{'|'.join(ARGUMENTS)})=", prompt)
    if first is None:
        return
    parts = [p.strip() for p in prompt[first.start() + 1:].split(",")]
    if all(re.fullmatch(rf"(?:{'|'.join(ARGUMENTS)})=[^=]*", p) for p in parts):
        raise UserError(f"{OWNER}: system_prompt must come last: its text {prompt!r} ends in model arguments "
                        f"({', '.join(p.split('=')[0] + '=' for p in parts)}), which would be read as its words: "
                        "give them before system_prompt")


# lighteval's GenerationParameters the engine takes (the model config's way to set sampling), by their model argument
TAKEN = ("temperature", "top_p", "top_k", "seed", "max_new_tokens")
# GenerationParameters at the values that change nothing (a config copied from another backend's may hold them);
# max_new_tokens 0 is lighteval's "the task's generation_size", as its own backends read it
NEUTRAL = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "min_p": 0.0,
           "min_new_tokens": 0, "stop_tokens": [], "truncate_prompt": False, "early_stopping": False,
           "max_new_tokens": 0}


def with_config(args: dict[str, str], generation: dict, system_prompt: str | None) -> dict[str, str]:
    """`args` (the model name's) with what the user set on lighteval's model config: `generation` (the
    GenerationParameters fields set) and its system_prompt. A setting given both ways must agree; one the engine does
    not take is refused, not ignored."""
    out = dict(args)
    if system_prompt and out.get("system_prompt", system_prompt.strip()) != system_prompt.strip():
        raise UserError(f"{OWNER}: system_prompt is {out['system_prompt']!r} in the model name and "
                        f"{system_prompt!r} in the model config: expected the same text both ways, or one of them")
    if system_prompt:
        out["system_prompt"] = system_prompt.strip()
    for key, value in generation.items():
        if value is None or NEUTRAL.get(key, object()) == value:  # unset, or a value that changes nothing
            continue
        if key not in TAKEN:
            raise UserError(f"{OWNER}: generation_parameters {key}={value!r}: the engine samples with "
                            f"{', '.join(TAKEN)} only: leave {key} unset")
        if key in out and typed(out[key]) != value:
            raise UserError(f"{OWNER}: {key} is {typed(out[key])!r} in the model name and {value!r} in the model "
                            "config: expected the same value both ways, or one of them")
        out[key] = str(value)
    return out


def typed(text: str):
    """A model argument's text as lm-eval types its own (handle_arg_string): digits an int, a float's text a float,
    anything else text; so that both integrations name a value alike ("width=1.5", "seed='abc'")."""
    if text.strip().lstrip("+-").isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def sampling_args(args: dict[str, str]) -> dict:
    """width, seed, max_new_tokens (None: by the task), temperature (None: by the document's sample count), top_p and
    top_k of the parsed `args`, each checked as the lm-eval backend and the engine check it."""
    args = {k: typed(v) for k, v in args.items()}
    out = {
        "width": positive_int(OWNER, "width", args.get("width", 1)),
        "seed": seed_arg(OWNER, args.get("seed", 0)),
        # None: the task's generation_size, else DEFAULT_NEW_TOKENS (given, it wins, as in lighteval's own backends)
        "max_new_tokens": positive_int(OWNER, "max_new_tokens", args["max_new_tokens"]) if "max_new_tokens" in args
        else None,
        "temperature": number(OWNER, "temperature", args["temperature"]) if "temperature" in args else None,
        "top_p": number(OWNER, "top_p", args.get("top_p", 1.0)),
        "top_k": integer(OWNER, "top_k", args.get("top_k", 0)),
    }
    try:
        check_sampling(0.0 if out["temperature"] is None else out["temperature"], out["top_p"])
    except ValueError as err:
        raise UserError(f"{OWNER}: {err}") from None
    check_int(f"{OWNER}: top_k", out["top_k"], low=0, note=" (0 = off)")
    return out
