"""Bridge as a lighteval custom model: each document's `num_samples` are drawn as Bridge groups.

lighteval's `custom` command loads the first LightevalModel subclass of a Python file, and hands it only a model
name; the model arguments ride in that name. A one-line file does (`bridge_model.py`):

    from bridgelm.integrations.lighteval import BridgeLightevalModel

    lighteval custom "pretrained=DIR,blocks=FILE,width=4" bridge_model.py "custom|mytask|0" --custom-tasks tasks.py

A task's sampling metrics (pass@k, G-Pass@k, mG-Pass with n samples) set each document's `num_samples`; those n
samples are drawn together by the engine in Bridge groups of `width` (which must divide n), so that siblings read
each other as in `bridgelm eval`. Documents with equal settings are sampled in one engine call. `loglikelihood`
scores each choice alone (a group of one: what Bridge changes is sampling), encoded as lighteval's transformers
backend encodes it (`encode_choice`); perplexity is not offered. Responses
are not cached by lighteval: a folder may hold new weights under the same name.

Model arguments: pretrained (folder or hub id), blocks (a block file; a folder saved with its blocks needs none),
width (default 1), seed (each document's samples drawn from a stream of its own: its task and prompt, whatever else
the run holds), dtype (float32, bfloat16, float16), device, max_new_tokens (given, it wins over a task's generation
size, as in lighteval's own backends; else the task's, else 256), temperature (default: 0, greedy, for a document of
one sample; 1.0 for several; 0 with several samples is refused), top_p, top_k,
chat (1: prompts in the tokenizer's chat template, 0: plain; by default, as lighteval's own backends, the
template where the tokenizer has one), system_prompt (last: it takes the rest of the name, commas included). The
model config's own `generation_parameters` (temperature, top_p, top_k, seed, max_new_tokens) and `system_prompt`,
lighteval's way to set them from Python, are read as well (one given both ways must agree; one the engine does not
take, such as repetition_penalty 1.2, is refused), and the config records the values given (a temperature left unset
is chosen by document: 0 for one sample, 1.0 for several).
"""

from __future__ import annotations

import warnings

from lighteval.models.abstract_model import LightevalModel
from lighteval.models.model_output import ModelResponse
from lighteval.tasks.prompt_manager import PromptManager
from lighteval.tasks.requests import Doc

import bridgelm
from bridgelm.engine import encode_text
from bridgelm.errors import DataWarning, UserError
from bridgelm.integrations.lighteval_args import (
    DEFAULT_NEW_TOKENS,
    OWNER,
    TAKEN,
    parse_model_args,
    sampling_args,
    with_config,
)
from bridgelm.integrations.loading import (
    cut_at_stop,
    in_own_words,
    load_bridge_model,
    one_group_at_least,
    score_ids,
)

def encode_choice(tokenizer, context: str, choice: str) -> tuple[list[int], list[int]]:
    """(context ids, choice ids) as lighteval's transformers backend encodes a loglikelihood request (pairwise): the
    context's trailing spaces moved to the choice, the two encoded apart, the choice without special tokens, a
    trailing EOS dropped from the context; the context with BOS as the engine adds it to the same prompt when it
    samples (one, where lighteval's backend doubles a chat template's), BOS (else EOS) alone when it is empty."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, choice = context[:-spaces], context[-spaces:] + choice
    ctx = encode_text(tokenizer, context) if context else []
    if ctx and ctx[-1] == tokenizer.eos_token_id:
        ctx = ctx[:-1]
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    return ctx or [start], tokenizer(choice, add_special_tokens=False)["input_ids"]


class _NoCache:
    """lighteval's pipeline hands a model's sample cache the task registry; this model keeps no cache."""

    def _init_registry(self, registry) -> None:
        pass


class BridgeLightevalModel(LightevalModel):
    """lighteval's view of a Bridge model: a document's `num_samples` drawn as Bridge groups of `width`."""

    def __init__(self, config):
        self.config = config  # lighteval's CustomModelConfig; its model_name holds the model arguments
        generation = config.generation_parameters  # what lighteval's own model configs set sampling with
        set_there = {k: getattr(generation, k) for k in generation.model_fields_set}
        args = with_config(parse_model_args(config.model_name), set_there, getattr(config, "system_prompt", None))
        sampling = sampling_args(args)  # checked before the model loads
        for key in TAKEN:  # lighteval records the config's: the values sampled with (temperature: by document)
            if sampling[key] is not None:
                setattr(generation, key, sampling[key])
        self.width, self.seed, self.max_new_tokens = sampling["width"], sampling["seed"], sampling["max_new_tokens"]
        self.temperature, self.top_p, self.top_k = sampling["temperature"], sampling["top_p"], sampling["top_k"]
        self.model, self._tokenizer, _ = load_bridge_model(
            OWNER, args["pretrained"], args.get("blocks"), self.width, args.get("dtype", "float32"),
            args.get("device", "cpu"),
        )
        # as lighteval's own backends decide: the chat template where the tokenizer has one, unless chat= says
        has_template = getattr(self._tokenizer, "chat_template", None) is not None
        self.chat = has_template if "chat" not in args else args["chat"] == "1"
        if self.chat and not has_template:
            raise UserError(f"{OWNER}: chat=1, but the tokenizer of {args['pretrained']} has no chat template: "
                            "expected chat=0, or a tokenizer with one")
        self.prompts = PromptManager(self.chat, self._tokenizer, args.get("system_prompt"))
        self._cache = _NoCache()

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def add_special_tokens(self) -> bool:
        return False  # prompts are tokenized by the engine, as `bridgelm eval` tokenizes them

    @property
    def max_length(self) -> int:
        return int(getattr(self.model.config.get_text_config(), "max_position_embeddings", None) or 2048)

    def settings(self, doc: Doc, prompt: str) -> dict:
        """bridgelm.generate's settings for `doc` (its sample count, generation size and stop sequences)."""
        n = doc.num_samples
        if n % self.width:
            raise UserError(
                f"{OWNER}: width={self.width} does not divide the {n} sample(s) of {doc.task_name or 'a task'}'s "
                "documents: expected num_samples (the n of its sampling metrics) that is a multiple of the width"
            )
        if n > 1 and self.temperature == 0:  # as lighteval's own transformers backend refuses it
            raise UserError(f"{OWNER}: temperature=0 draws the same sample {n} times for the sampling metrics of "
                            f"{doc.task_name or 'a task'} (num_samples {n}): expected temperature > 0")
        temperature = self.temperature if self.temperature is not None else (0.0 if n == 1 else 1.0)
        stops = () if self.chat else tuple(s for s in doc.stop_sequences or () if s)  # chat: EOS ends a turn
        wanted = self.max_new_tokens or doc.generation_size or DEFAULT_NEW_TOKENS
        return {"n": n, "max_new_tokens": self.new_tokens(doc, prompt, wanted),
                "stop_strings": stops, "temperature": temperature, "top_p": self.top_p, "top_k": self.top_k}

    def new_tokens(self, doc: Doc, prompt: str, wanted: int) -> int:
        """`wanted`, or the positions the document's prompt leaves when fewer (cut with a warning, as lighteval's
        backend cuts them); a prompt that leaves none is refused, naming its task."""
        length = len(encode_text(self._tokenizer, prompt))
        room = self.max_length - length
        if room < 1:
            raise UserError(f"{OWNER}: a document of {doc.task_name or 'a task'} has a prompt of {length} tokens, "
                            f"which fills the model's {self.max_length} positions: expected shorter prompts (fewer "
                            "few-shot examples) or a model with more positions")
        if room < wanted:
            warnings.warn(f"{OWNER}: a document of {doc.task_name or 'a task'} has a prompt of {length} tokens: its "
                          f"samples get {room} new tokens, not {wanted} (the model has {self.max_length} positions)",
                          DataWarning, stacklevel=2)
        return min(wanted, room)

    def greedy_until(self, docs: list[Doc]) -> list[ModelResponse]:
        """Each document's num_samples samples, drawn in Bridge groups; one engine call per distinct settings."""
        prompts = [self.prompts.prepare_prompt(doc) for doc in docs]  # each once: its length and its samples
        calls: dict[tuple, list[int]] = {}  # settings -> the documents sampled in one engine call
        for i, doc in enumerate(docs):
            calls.setdefault(tuple(sorted(self.settings(doc, prompts[i]).items())), []).append(i)
        out: list[ModelResponse | None] = [None] * len(docs)
        for settings, indices in calls.items():
            kwargs = dict(settings)
            texts = [prompts[i] for i in indices]
            # a document's random stream is its own (task and prompt), whatever else the call or the run holds
            keys = [(docs[i].task_name, prompts[i]) for i in indices]
            bound = one_group_at_least(self._tokenizer, texts, self.width, kwargs["max_new_tokens"])
            try:
                drawn = bridgelm.generate(self.model, self._tokenizer, texts, width=self.width, seed=self.seed,
                                          keys=keys, max_batch_tokens=bound, **kwargs)
            except UserError as err:  # the engine's refusal, as this model says it
                raise in_own_words(err, OWNER, "max_new_tokens") from None
            for i, prompt, samples in zip(indices, texts, drawn):
                out[i] = ModelResponse(
                    input=prompt,
                    text=[cut_at_stop(s.text, kwargs["stop_strings"]) for s in samples],
                    output_tokens=[list(s.token_ids) for s in samples],
                )
        return out

    def loglikelihood(self, docs: list[Doc]) -> list[ModelResponse]:
        """log p(choice | prompt) of each choice of each document, each scored alone; contexts longer than the
        model's positions lose their first tokens."""
        out = []
        for doc in docs:
            context = self.prompts.prepare_prompt(doc)
            pairs = [encode_choice(self._tokenizer, context, choice) for choice in doc.choices]
            scores = [score_ids(self.model, ctx, cont, max_length=self.max_length) for ctx, cont in pairs]
            out.append(ModelResponse(input=context, input_tokens=pairs[0][0] if pairs else [],
                                     output_tokens=[cont for _, cont in pairs], logprobs=[lp for lp, _ in scores],
                                     argmax_logits_eq_gold=[greedy for _, greedy in scores]))
        return out

    def loglikelihood_rolling(self, docs: list[Doc]) -> list[ModelResponse]:
        raise UserError(
            f"{OWNER}: loglikelihood_rolling (perplexity tasks) is not offered: Bridge changes how samples are drawn, "
            "not how one text is scored; use lighteval's transformers backend for perplexity"
        )
