"""Summarisation (XSum, CNN/DailyMail), scored by ROUGE-1 F1 against the reference summary (paper Table 2).

Design notes:
- Rows are in each data set's public column layout: XSum `document`, `summary` (EdinburghNLP/xsum);
  CNN/DailyMail 3.0.0 `article`, `highlights` (abisee/cnn_dailymail, config 3.0.0). Local .jsonl/.json/.parquet
  files or a folder with `<split>.*`; with no path, the hub id through `datasets` (needs a network).
- Prompt (HELM's wording, as in Lighteval's summarisation tasks), one user message:

      Article: {document}

      Summarize the above article in 1 sentence.          (CNN/DailyMail: "in 3 sentences")

- Answer format: the summary is the completion's text after its last `</think>` (R1-style models think
  first; the whole completion when there is none), stripped, with a leading "Summary:" label dropped. A
  completion that opened `<think>` and never closed it has no summary (score 0).
- Score: ROUGE-1 F1 of that summary against the reference, from Google's `rouge-score` with Porter stemming
  (`bridgelm.rouge`). The score is continuous (`continuous = True`): eval runs report its mean, a 95%
  interval, and the per-prompt variance across the response set (paper Table 5), not pass@k or G-Pass.
- Long documents: `long_field()` names the document field, which `bridgelm eval` cuts so that the prompt fits
  the model's context minus max_new_tokens (the cut is recorded in the run), instead of refusing the run.

    bridgelm eval --model M --task xsum --data xsum_test.jsonl --n 32 --width 8 --chat --out runs/xsum
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from bridgelm import rouge
from bridgelm.errors import UserError
from bridgelm.tasks.answers import after_thinking
from bridgelm.tasks.base import Task, load_rows


@dataclass(frozen=True)
class Layout:
    """Where a data set keeps its text, and how long a summary it asks for."""

    document: str  # field holding the text to summarise
    summary: str  # field holding the reference summary
    sentences: str  # length the prompt asks for, e.g. "1 sentence"
    hub_id: str  # hub id used when no path is given
    hub_config: str | None  # hub configuration (CNN/DailyMail: "3.0.0")


LAYOUTS = {
    "xsum": Layout("document", "summary", "1 sentence", "EdinburghNLP/xsum", None),
    "cnn_dailymail": Layout("article", "highlights", "3 sentences", "abisee/cnn_dailymail", "3.0.0"),
}

# ROUGE type of the score (paper Table 2 reports ROUGE-1).
ROUGE_TYPE = "rouge1"

# A label some models put before the summary.
_LABEL_RE = re.compile(r"^\s*(?:\*\*)?summary(?:\*\*)?\s*[:：]\s*(?:\*\*)?", re.IGNORECASE)


def summary_of(completion: str | None) -> str | None:
    """The summary written in a completion (see the module notes), or None when there is none."""
    text = completion or ""
    if "<think>" in text and "</think>" not in text:
        return None  # still thinking when it stopped
    text = _LABEL_RE.sub("", after_thinking(text).strip(), count=1).strip()
    return text or None


def rouge1(summary: str | None, reference: str) -> float:
    """ROUGE-1 F1 (stemmed, rouge-score) of `summary` against `reference`; no summary scores 0."""
    if summary is None:
        return 0.0
    return rouge.f1_scores(reference, summary, (ROUGE_TYPE,))[ROUGE_TYPE]


@dataclass
class Summarization(Task):
    """Summarise a document; the reward is ROUGE-1 F1 against the reference summary."""

    layout: Layout = LAYOUTS["xsum"]  # fields of the rows and the prompt's length request

    continuous: ClassVar[bool] = True

    def prompt(self, example: dict) -> str:
        document = str(example[self.layout.document]).strip()
        return f"Article: {document}\n\nSummarize the above article in {self.layout.sentences}."

    def answer(self, example: dict) -> str:
        return str(example[self.layout.summary]).strip()

    def extract(self, completion: str) -> str | None:
        return summary_of(completion)

    def reward(self, completion: str, example: dict) -> float:
        return rouge1(summary_of(completion), self.answer(example))

    def long_field(self) -> str | None:
        return self.layout.document


def load_dataset_rows(name: str, path: str | None, split: str) -> Summarization:
    """The summarisation task `name` (a key of LAYOUTS) with rows from `path` (None: the hub id)."""
    layout = LAYOUTS[name]
    fields = (layout.document, layout.summary)
    source = path if path is not None else layout.hub_id
    rows = load_rows(source, split, fields, hub_config=layout.hub_config if path is None else None)
    for i, row in enumerate(rows, 1):
        for key in fields:
            if not isinstance(row[key], str) or not row[key].strip():
                raise UserError(f"{source}: row {i}: field {key!r} is {row[key]!r}: expected non-empty text")
    return Summarization(name=name, examples=rows, layout=layout)


def load_xsum(path: str | None = None, split: str = "test") -> Summarization:
    """XSum rows (`document`, `summary`) from a local file/folder, or EdinburghNLP/xsum when path is None."""
    return load_dataset_rows("xsum", path, split)


def load_cnn_dailymail(path: str | None = None, split: str = "test") -> Summarization:
    """CNN/DailyMail 3.0.0 rows (`article`, `highlights`) from a local file/folder, or the hub when path is None."""
    return load_dataset_rows("cnn_dailymail", path, split)
