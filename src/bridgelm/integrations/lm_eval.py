"""Bridge as an lm-evaluation-harness model backend, registered as `bridgelm` when this module is imported.

    import bridgelm.integrations.lm_eval  # registers the backend (lm-eval 0.4.13 has no plugin discovery)
    lm_eval.simple_evaluate(model="bridgelm", model_args="pretrained=DIR,blocks=FILE,width=8", tasks=[...])

or from the shell, lm-eval's own command line with the backend registered:

    bridgelm lm-eval run --model bridgelm --model_args pretrained=DIR,blocks=FILE,width=8 --tasks gsm8k

A task with `repeats: N` hands `generate_until` the N copies of each request side by side (the same Instance object).
They are regrouped here: the N samples of a request are drawn together by the engine, in Bridge groups of `width`
(which must divide N), so that siblings read each other as in `bridgelm eval`. Requests with equal generation settings
and repeats are sampled in one engine call, each from a random stream of its own (its task and prompt), so that its
samples do not change with the other requests of the run. `loglikelihood` scores each request alone (a group of one:
what Bridge changes is sampling), tokenized as lm-eval's hf backend tokenizes it (its BOS included);
`loglikelihood_rolling` (perplexity) is not offered.

Model arguments: pretrained (folder or hub id; from Python also a model object, used as it is, with its tokenizer),
blocks (a block file; a folder saved with its blocks needs none), width (default 1), seed (default: the torch seed
lm-eval set before it made the backend, `--seed`'s third value, 1234 unless given; 0 for a backend made by hand),
dtype (float32, bfloat16, float16), device, max_new_tokens (when a task gives no max_gen_toks), revision (of a hub
id), tokenizer (another folder or id for it), max_length (the positions loglikelihood scores: longer contexts lose
their first tokens, as in the hf backend; default the model's), and batch_size 1 or auto (the engine sizes its own
waves: another value is refused); chat is lm-eval's own `--apply_chat_template`. Generation settings a task gives
that the engine does not take (num_beams > 1, repetition_penalty != 1, ...) are refused, not ignored.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import lm_eval.models  # noqa: F401 - lm-eval's own backends (hf, vllm, ...): registered first, or never in this process
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

import bridgelm
from bridgelm.engine import encode_text
from bridgelm.errors import UserError
from bridgelm.integrations.loading import (
    cut_at_stop,
    integer,
    in_own_words,
    load_bridge_model,
    model_in_memory,
    one_group_at_least,
    seed_arg,
    number,
    positive_int,
    score_ids,
)

OWNER = "bridgelm backend"  # how errors name this backend
IGNORED = ("max_batch_size",)  # lm-eval passes it to every backend with batch_size; the engine sizes its own waves
# generation_kwargs the engine honours, and those it takes only at the value that changes nothing
SAMPLING_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")
NO_OPS = {"num_beams": 1, "repetition_penalty": 1.0, "min_p": 0.0, "num_return_sequences": 1}


def _positive(name: str, value) -> int:
    return positive_int(OWNER, name, value)


def request_runs(requests: Sequence) -> list[tuple[int, int]]:
    """(start, count) of each request's copies: lm-eval repeats a request by listing the same Instance `repeats`
    times in a row (more when it pads ranks), so a run of one object is cut every `repeats` copies."""
    runs, start = [], 0
    for _, copies in itertools.groupby(range(len(requests)), key=lambda i: id(requests[i])):
        count = len(list(copies))
        per = max(1, getattr(requests[start], "repeats", None) or count)
        runs += [(s, min(per, start + count - s)) for s in range(start, start + count, per)]
        start += count
    return runs


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's hf backend makes them, so that scores compare: the context's
    trailing spaces move to the continuation; the pair is encoded whole with the tokenizer's own special tokens
    (its BOS, where it adds one; none when the text already starts with it) and cut at the context's length; an
    empty context is the BOS (else EOS) token."""
    if not context:
        cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return ([prefix], cont) if not cont or cont[0] != prefix else (cont[:1], cont[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole, ctx = encode_text(tokenizer, context + continuation), encode_text(tokenizer, context)
    return ctx, whole[len(ctx):]


def sampling_settings(gen_kwargs: dict, default_max_new_tokens: int) -> dict:
    """bridgelm.generate's settings from a task's generation_kwargs (until, max_gen_toks, do_sample, temperature,
    top_p, top_k), read as lm-eval's own backends read them (`normalize_gen_kwargs`): greedy unless the task samples
    (a temperature above 0), so that a task scores alike under `--model hf` and `--model bridgelm`. do_sample true
    without a temperature samples at 1.0, transformers' default (lm-eval's hf backend passes 0 there, which fails)."""
    kwargs = dict(gen_kwargs or {})
    for key, value in kwargs.items():
        if key not in SAMPLING_KEYS and not (key in NO_OPS and value == NO_OPS[key]):
            raise UserError(
                f"{OWNER}: the task's generation setting {key}={value!r} is not one bridgelm's engine takes: expected "
                f"only {', '.join(SAMPLING_KEYS)}" + (f" ({key}={NO_OPS[key]!r} at most)" if key in NO_OPS else "")
            )
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    sample = kwargs.get("do_sample")
    temperature = number(OWNER, "temperature", kwargs.get("temperature", 1.0 if sample is True else 0.0))
    greedy = sample is False or temperature == 0.0
    return {
        "stop_strings": tuple(s for s in until if s),
        "max_new_tokens": _positive("max_gen_toks", kwargs.get("max_gen_toks", default_max_new_tokens)),
        "temperature": 0.0 if greedy else temperature,
        "top_p": number(OWNER, "top_p", kwargs.get("top_p", 1.0)),
        "top_k": integer(OWNER, "top_k", kwargs.get("top_k", 0) or 0),
    }


@register_model("bridgelm")
class BridgeLM(LM):
    """lm-eval's view of a Bridge model: text in, text out, each request's repeats drawn as Bridge groups."""

    def __init__(self, pretrained: str | None = None, blocks: str | None = None, width: int = 1, seed: int = 0,
                 dtype: str = "float32", device: str = "cpu", max_new_tokens: int = 256, revision: str | None = None,
                 tokenizer: str | None = None, max_length: int | None = None, batch_size=1, **kwargs):
        super().__init__()
        unknown = sorted(k for k in kwargs if k not in IGNORED)
        if unknown:
            raise UserError(
                f"bridgelm backend: unknown model argument(s) {', '.join(unknown)}: expected pretrained, blocks, "
                "width, seed, dtype, device, max_new_tokens, revision, tokenizer, max_length, batch_size"
            )
        if str(batch_size) not in ("1", "auto") and not str(batch_size).startswith("auto:"):
            raise UserError(f"bridgelm backend: batch_size={batch_size!r}: the engine sizes its own waves of rows "
                            "(Bridge groups kept whole): expected batch_size 1 or auto")
        self.width, self.seed = _positive("width", width), seed_arg(OWNER, seed)
        self.max_new_tokens = _positive("max_new_tokens", max_new_tokens)
        self.max_length = None if max_length is None else _positive("max_length", max_length)
        if isinstance(pretrained, torch.nn.Module):  # a model of this process, as lm-eval's hf backend takes one
            self.model, self.tokenizer, self._device = model_in_memory(OWNER, pretrained, tokenizer, blocks, self.width)
        else:
            self.model, self.tokenizer, self._device = load_bridge_model(
                OWNER, pretrained, blocks, self.width, dtype, device, revision=revision, tokenizer=tokenizer
            )
        if self.max_length is None:
            self.max_length = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if isinstance(pretrained, torch.nn.Module):  # named by its folder where it has one
            self.pretrained = getattr(self.model, "name_or_path", None) or type(self.model).__name__
        else:
            self.pretrained = pretrained

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> BridgeLM:
        """lm-eval's command line hands its --device and --batch_size (their defaults too: cuda:0, 1) beside the
        model arguments; device or batch_size given as a model argument is the one meant, and wins. The sampling
        seed, unless a model argument gives it, is lm-eval's torch seed (--seed's third value, default 1234)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        if "seed" not in arg_dict:  # lm-eval's --seed (simple_evaluate's torch_random_seed) seeds torch just before
            extra["seed"] = torch.initial_seed()
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> BridgeLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def tokenizer_name(self) -> str:
        return str(self.pretrained).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        calls: dict[tuple, list[tuple[int, int]]] = {}  # (settings, repeats) -> runs sampled in one engine call
        for start, count in request_runs(requests):
            context, gen_kwargs = requests[start].args
            settings = sampling_settings(gen_kwargs, self.max_new_tokens)
            calls.setdefault((tuple(sorted(settings.items())), count), []).append((start, count))
        for (settings, count), runs in calls.items():
            if count % self.width:
                task = getattr(requests[runs[0][0]], "task_name", None) or "a task"
                raise UserError(
                    f"bridgelm backend: width={self.width} does not divide the {count} repeat(s) of {task}'s requests: "
                    "expected repeats that are a multiple of the width (set the task's `repeats`, or width=1)"
                )
            prompts = [requests[start].args[0] for start, _ in runs]
            # a request's random stream is its own (task and prompt), whatever else the call or the run holds
            keys = [(getattr(requests[start], "task_name", None), requests[start].args[0]) for start, _ in runs]
            kwargs = dict(settings)
            kwargs["max_batch_tokens"] = one_group_at_least(self.tokenizer, prompts, self.width,
                                                            kwargs["max_new_tokens"])
            try:
                samples = bridgelm.generate(
                    self.model, self.tokenizer, prompts, n=count, width=self.width, seed=self.seed, keys=keys,
                    progress=not disable_tqdm, **kwargs
                )
            except UserError as err:  # in lm-eval's words
                raise in_own_words(err, OWNER, "the task's max_gen_toks") from None
            for (start, _), drawn in zip(runs, samples):
                for j, sample in enumerate(drawn):
                    out[start + j] = cut_at_stop(sample.text, kwargs["stop_strings"])
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        from bridgelm.progress import bar

        shown, scores = bar(len(requests), "loglikelihood", "request", enabled=not disable_tqdm), []
        for request in requests:  # the bar as every bridgelm bar (TQDM_DISABLE=1 silences it)
            context, continuation = encode_pair(self.tokenizer, *request.args)
            scores.append(score_ids(self.model, context, continuation, max_length=self.max_length))
            shown.update(1)
        shown.close()
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise UserError(
            "bridgelm backend: loglikelihood_rolling (perplexity tasks) is not offered: Bridge changes how samples are "
            "drawn, not how one text is scored; use lm-eval's hf backend for perplexity"
        )
