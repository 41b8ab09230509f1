"""How alike a prompt's responses are (paper Table 5), over an eval run's samples.

- Output similarity: ROUGE-L F1, and ROUGE-1 F1 beside it, from Google's `rouge-score` (stemmed, its own
  tokenizer; `bridgelm.rouge`), averaged over all pairs of one prompt's responses, then over prompts. Two
  responses without any ROUGE token (empty, or no [a-z0-9]) count as identical (1.0); rouge-score alone says 0.
  rouge-score's LCS is quadratic pure Python (about 0.2 s for a pair of 1,000-word texts): long reasoning
  traces at n=32 (496 pairs a prompt) are slow, and `--max-samples` bounds the pairs.
- Embedding similarity (the paper's BERTScore stands in for it) needs sentence-transformers and a model that is
  already on disk; otherwise it is skipped with the reason. Nothing is ever downloaded.

    bridgelm analyze similarity --run runs/x
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bridgelm import rouge
from bridgelm.errors import UserError
from bridgelm.eval.folder import read_samples
from bridgelm.intervals import bootstrap_ci
from bridgelm.jsonl import write_json
from bridgelm.progress import bar as progress_bar

# Similarity measures of `set_similarity`, each an F1 from rouge-score.
SIMILARITY_METRICS = ("rouge_l", "rouge_1")

# Sentence-embedding model tried for the embedding similarity (used only when it is on disk already).
DEFAULT_EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"


# ---------------------------------------------------------------------------------------------- similarity


def pair_similarity(a: str, b: str) -> dict[str, float]:
    """{"rouge_l", "rouge_1"}: ROUGE-L and ROUGE-1 F1 of two texts (symmetric), from rouge-score.

    Two texts without ROUGE tokens are identical (1.0 each); one without gives 0.0.
    """
    f1 = rouge.f1_scores(a, b, ("rougeL", "rouge1"))
    if f1["rouge1"] == 0.0 and not rouge.tokens(a) and not rouge.tokens(b):  # tokenized again only then
        return {"rouge_l": 1.0, "rouge_1": 1.0}
    return {"rouge_l": f1["rougeL"], "rouge_1": f1["rouge1"]}


def rouge_l(a: str, b: str) -> float:
    """ROUGE-L F1 of two texts (see `pair_similarity`)."""
    return pair_similarity(a, b)["rouge_l"]


def _pairwise_mean(texts: Sequence[str]) -> tuple[dict[str, float], int]:
    values = [pair_similarity(texts[i], texts[j]) for i in range(len(texts)) for j in range(i + 1, len(texts))]
    return {m: float(np.mean([v[m] for v in values])) for m in SIMILARITY_METRICS}, len(values)


def set_similarity(
    samples_by_problem: Sequence[Sequence[str]], max_samples: int | None = None, progress: bool = False
) -> dict[str, Any]:
    """Mean pairwise ROUGE-L and ROUGE-1 F1 within each prompt's response set, averaged over prompts (with 95%
    intervals): {"rouge_l", "rouge_1", "problems", "pairs"}.

    `max_samples` keeps the first responses of each set (pairs grow as n^2). Sets with < 2 responses are skipped.
    """
    per_problem: dict[str, list[float]] = {m: [] for m in SIMILARITY_METRICS}
    pairs = 0
    bar = progress_bar(len(samples_by_problem), "ROUGE-L / ROUGE-1", "problem", enabled=progress)
    for texts in samples_by_problem:
        bar.update(1)
        texts = list(texts)[:max_samples] if max_samples else list(texts)
        if len(texts) < 2:
            continue
        means, count = _pairwise_mean(texts)
        for m in SIMILARITY_METRICS:
            per_problem[m].append(means[m])
        pairs += count
    bar.close()
    if not per_problem["rouge_l"]:
        raise UserError("no response set has 2 or more responses: nothing to compare")
    out: dict[str, Any] = {}
    for m, values in per_problem.items():
        low, high = bootstrap_ci(values)
        out[m] = {"mean": float(np.mean(values)), "low": low, "high": high}
    out.update(problems=len(per_problem["rouge_l"]), pairs=pairs)
    return out


def embedding_similarity(
    samples_by_problem: Sequence[Sequence[str]], model_name: str = DEFAULT_EMBEDDER, max_samples: int | None = None
) -> dict[str, Any]:
    """Mean pairwise cosine of sentence embeddings within each response set, or {"skipped": reason}.

    Uses sentence-transformers with `model_name` from the local cache only; never downloads.
    """
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return {"skipped": "sentence-transformers is not installed"}
    try:
        embedder = SentenceTransformer(model_name, local_files_only=True)
    except Exception as err:  # not on disk, or a package version without local_files_only: never download
        reason = f"{type(err).__name__}: {err}"[:240]
        return {"skipped": f"no local copy of {model_name} ({reason}); nothing is downloaded"}
    per_problem = []
    for texts in samples_by_problem:
        texts = list(texts)[:max_samples] if max_samples else list(texts)
        if len(texts) < 2:
            continue
        emb = np.asarray(embedder.encode(texts, normalize_embeddings=True))  # [n, E], unit rows
        sim = emb @ emb.T  # [n, n] cosines
        upper = sim[np.triu_indices(len(texts), k=1)]
        per_problem.append(float(upper.mean()))
    if not per_problem:
        return {"skipped": "no response set has 2 or more responses"}
    low, high = bootstrap_ci(per_problem)
    return {"model": model_name, "cosine": {"mean": float(np.mean(per_problem)), "low": low, "high": high}}


def run_similarity(
    run_dir: str | os.PathLike,
    benchmark: str | None = None,
    width: int | None = None,
    max_samples: int | None = None,
    embedding_model: str | None = DEFAULT_EMBEDDER,
    out: str | os.PathLike | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """ROUGE-L, ROUGE-1 (and embedding) similarity of each (benchmark, width) of a run; written to `out` (default
    RUN_DIR/similarity.json) as {benchmark: {width: {"rouge_l", "rouge_1", "problems", "pairs", "embedding"}}}."""
    records = read_samples(run_dir)
    groups: dict[tuple[str, int], list[list[str]]] = {}
    for key in sorted(records):
        if (benchmark is None or key[0] == benchmark) and (width is None or key[1] == width):
            groups.setdefault(key[:2], []).append([s["text"] for s in records[key]["samples"]])
    if not groups:
        where = "" if benchmark is None else f" of benchmark {benchmark!r}"
        where += "" if width is None else f" at width {width}"
        raise UserError(f"{run_dir} has no sampled problems{where}: --benchmark and --width name what it holds")
    result: dict[str, dict] = {}
    for (bench, w), sets in groups.items():
        entry = set_similarity(sets, max_samples, progress)
        if embedding_model:
            entry["embedding"] = embedding_similarity(sets, embedding_model, max_samples)
        result.setdefault(bench, {})[str(w)] = entry
    write_json(Path(out) if out else Path(run_dir) / "similarity.json", result)
    return result
