"""ROUGE through Google's reference implementation (`rouge-score`), shared by the summarisation tasks and the
similarity analysis.

Design notes:
- One `RougeScorer` per (types, stemming) is built once and reused; scoring is a pure function of two texts.
- Stemming (Porter, words longer than 3 characters) is on by default, the usual setting for summarisation
  (Lighteval, HELM and the XSum/CNN-DM papers report stemmed ROUGE).
- rouge-score's tokenizer lowercases and keeps only [a-z0-9] runs: text in other scripts has no tokens and
  scores 0 (the reference implementation's behaviour, kept as is).
- F1 of ROUGE-1 and ROUGE-L is symmetric in its two texts; `score(reference, prediction)` keeps rouge-score's
  argument order (target first) anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

# ROUGE types this project reports: unigram overlap (paper Table 2) and longest common subsequence.
ROUGE_TYPES = ("rouge1", "rougeL")


@lru_cache(maxsize=8)
def _scorer(types: tuple[str, ...], stem: bool):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(types), use_stemmer=stem)


def f1_scores(reference: str, prediction: str, types: Sequence[str] = ROUGE_TYPES, stem: bool = True) -> dict:
    """{type: F1} of `prediction` against `reference` for each ROUGE type ("rouge1", "rouge2", "rougeL", ...)."""
    assert isinstance(reference, str) and isinstance(prediction, str), (type(reference), type(prediction))
    scores = _scorer(tuple(types), bool(stem)).score(reference, prediction)
    return {t: float(scores[t].fmeasure) for t in types}


@lru_cache(maxsize=2)
def _tokenizer(stem: bool):
    from rouge_score.tokenizers import DefaultTokenizer

    return DefaultTokenizer(use_stemmer=stem)


def tokens(text: str, stem: bool = True) -> list[str]:
    """The tokens that rouge-score compares (lowercased alphanumeric runs, stemmed when `stem`)."""
    return list(_tokenizer(bool(stem)).tokenize(text))
