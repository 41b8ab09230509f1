"""Long documents in an eval prompt: a prompt longer than the context left after max_new_tokens has its long field
(a task's `long_field`, e.g. the article of a summary) cut to the longest token prefix that fits (`fit_prompt`).

Used by bridgelm.eval.runner; tested by tests/test_nonmath_eval.py.
"""

from __future__ import annotations

from bridgelm.engine import encode_prompts
from bridgelm.errors import UserError
from bridgelm.tasks import Task


def prompt_budget(model, max_new_tokens: int) -> int | None:
    """Most prompt tokens a sample may have: the model's context minus max_new_tokens (None: no known context)."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return None if context is None else int(context) - int(max_new_tokens)


def _token_ends(tokenizer, text: str) -> list[int]:
    """Character offset where each token of `text` ends (slow tokenizers: lengths of decoded prefixes)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [int(end) for _, end in enc["offset_mapping"]]
    except (NotImplementedError, KeyError, TypeError):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return [len(tokenizer.decode(ids[: k + 1])) for k in range(len(ids))]


def fit_prompt(task: Task, example: dict, tokenizer, chat: bool, budget: int | None) -> tuple[str, dict | None]:
    """(prompt, cut) of `example`: when its prompt has more than `budget` tokens and the task names a long field,
    that field is cut to its longest token prefix whose prompt fits; `cut` describes it (None: nothing cut).

    A prompt that does not fit even with the field empty is a ValueError naming the sizes.
    """
    text = task.prompt(example)
    field_name = task.long_field()
    if field_name is None or budget is None:
        return text, None
    count = lambda t: len(encode_prompts(tokenizer, [t], chat, warn=False)[0])  # noqa: E731 (sampling warns)
    full = count(text)
    if full <= budget:
        return text, None
    document = str(example[field_name])
    ends = _token_ends(tokenizer, document)
    shortened = lambda k: task.prompt({**example, field_name: document[: ends[k - 1]] if k else ""})  # noqa: E731
    if count(shortened(0)) > budget:
        raise UserError(
            f"the prompt has {count(shortened(0))} tokens even with its {field_name!r} empty: more than the "
            f"{budget} tokens left by the context after max_new_tokens; lower --max-new-tokens"
        )
    lo, hi = 0, len(ends)  # the largest k whose prompt fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(shortened(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    cut = {
        "field": field_name,
        "prompt_tokens": full,  # before the cut
        "field_tokens": len(ends),
        "kept_tokens": lo,
        "kept_chars": ends[lo - 1] if lo else 0,
        "budget": budget,
    }
    return shortened(lo), cut
