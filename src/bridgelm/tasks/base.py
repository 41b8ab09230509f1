"""Task base class and the shared row loader.

Design: a task is a list of example dicts plus four pure functions of them (prompt, gold answer,
answer extraction, reward). Tasks never touch the network at construction unless asked to load
from a dataset hub; local files are the normal path (`.jsonl`, `.json`, `.parquet`). Loader errors
name the file, the 1-based line (or item) and the missing field, because data files are edited by
hand. Each task passes a `check` of its rows to the loader (non-empty problem, a gold answer that
parses), so a bad row is refused on load, by line, instead of being sampled and scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from bridgelm.errors import MissingFile, UserError
from bridgelm.jsonl import check_regular_file, json_lines, parse_json

# The DeepSeek-R1 evaluation instruction appended to every math-style problem.
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# File suffixes that read_rows understands.
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def with_instruction(problem: str, instruction: str = BOXED_INSTRUCTION) -> str:
    """`problem` + newline + `instruction`, unless the problem already ends with the instruction."""
    text = problem.rstrip()
    if text.endswith(instruction):
        return text
    return f"{text}\n{instruction}"


def format_chat(tokenizer: Any, text: str) -> str:
    """Wrap `text` as one user turn with the tokenizer's chat template, ready for generation.

    Tokenizers without a chat template (base models, tiny test models) get the text unchanged.
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
    return text


# The reward of a correct answer. Rewards are correctness in [0, 1]: every task here gives 0 or 1, except the graded
# scores of continuous tasks (summarisation's ROUGE-1), which count as correct only when perfect.
FULL_REWARD = 1.0


def is_correct(reward: float) -> bool:
    """A sample is correct when its reward is the full reward: what accuracy, pass@k, G-Pass, majority vote, the
    warm-up data filter and RL's accuracy all count."""
    return reward >= FULL_REWARD


def check_rewards(rewards: Sequence[float], where: str) -> list[float]:
    """Rewards as floats; a non-finite one is a ValueError naming `where` and the response."""
    out = []
    for i, r in enumerate(rewards):
        r = float(r)
        if not math.isfinite(r):
            raise ValueError(f"{where}: reward of response {i} is {r}; expected a finite number in [0, 1]")
        out.append(r)
    return out


@dataclass
class Task:
    """A benchmark: examples plus prompt, gold answer, answer extraction and reward.

    Subclasses override `prompt`, `answer`, `extract` and `reward`; `reward_many` exists so that
    graders with a per-call overhead (math) can batch.
    """

    name: str  # registry name, e.g. "gsm8k"
    examples: list[dict] = field(default_factory=list)  # one dict per problem, task-specific keys

    # True when `reward` is a graded score in [0, 1] (ROUGE) rather than correct (1) / incorrect (0): eval runs
    # then report the mean score and its per-prompt variance instead of pass@k, G-Pass and majority vote.
    continuous: ClassVar[bool] = False
    # True when a problem has several correct answers that `extract` tells apart (Countdown's expressions): what
    # `bridgelm rl --reward distinct` (coverage of distinct correct answers) needs.
    several_answers: ClassVar[bool] = False

    def __len__(self) -> int:
        return len(self.examples)

    def prompt(self, example: dict) -> str:
        """The raw user message for `example` (no chat template applied)."""
        raise NotImplementedError(f"task {self.name!r} does not define prompt()")

    def answer(self, example: dict) -> str:
        """The gold answer of `example`, as text."""
        raise NotImplementedError(f"task {self.name!r} does not define answer()")

    def extract(self, completion: str) -> str | None:
        """The final answer parsed from a completion (for majority voting), or None."""
        raise NotImplementedError(f"task {self.name!r} does not define extract()")

    def reward(self, completion: str, example: dict) -> float:
        """1.0 if `completion` answers `example` correctly, else 0.0."""
        raise NotImplementedError(f"task {self.name!r} does not define reward()")

    def graded_text(self, completion: str, finished: bool) -> str:
        """What `extract` and `reward` read of a completion; `finished` False: cut by the token limit, before its
        end. A cut completion that has not given its final answer yet (`answered`) is graded as saying nothing."""
        return completion if finished or self.answered(completion) else ""

    def answered(self, completion: str) -> bool:
        """Whether a completion states its final answer explicitly. True by default; a task whose extraction falls
        back on incidental text (GSM8K's last number, math-verify's bare numbers) says what counts, so that a
        completion cut by the token limit is not graded on a number it happened to write last."""
        return True

    def long_field(self) -> str | None:
        """The example field that may be shortened so that the prompt fits the model's context (None: never)."""
        return None

    def reward_many(self, pairs: Sequence[tuple[str, dict]]) -> list[float]:
        """Rewards of (completion, example) pairs; the default just loops."""
        return [self.reward(completion, example) for completion, example in pairs]

    def digest(self, examples: Sequence[dict] | None = None) -> str:
        """Fingerprint of the prompts and gold answers of `examples` (None: all of the task's), recorded by the runs
        that read them, so that a changed data file cannot be mixed into a run or resume one."""
        from bridgelm.runs import fingerprint

        return fingerprint(
            [self.prompt(ex), self.answer(ex)] for ex in (self.examples if examples is None else examples)
        )


def is_local_source(path: str | Path) -> bool:
    """True when `path` names a local file or folder (existing, or with a data-file suffix)."""
    p = Path(path)
    return p.exists() or p.suffix in LOCAL_SUFFIXES or str(path).startswith((".", "/", "~"))


# A row check: raises ValueError (naming the field, its value and what was expected) for a bad row.
RowCheck = Callable[[dict], None]


def require_text(row: dict, name: str) -> str:
    """`row[name]` when it is non-empty text, else a ValueError naming the field and its value."""
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {name!r} is {value!r}: expected non-empty text")
    return value


def _check_row(row: Any, required_fields: Sequence[str], where: str, check: RowCheck | None = None) -> dict:
    """`row` if it is an object with all required fields that passes `check`, else a UserError naming `where`."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name in required_fields:
        if name not in row:
            raise UserError(f"{where}: missing field {name!r} (expected fields: {', '.join(required_fields)})")
    if check is not None:
        try:
            check(row)
        except (ValueError, TypeError) as exc:
            raise UserError(f"{where}: {exc}") from exc
    return row


def _read_jsonl(path: Path, required_fields: Sequence[str], check: RowCheck | None = None) -> list[dict]:
    """Rows of a JSON-lines file (jsonl.json_lines: strict, blank lines skipped)."""
    rows, _ = json_lines(path.read_bytes(), path)
    return [_check_row(row, required_fields, f"{path}, line {number}", check) for number, row in rows]


def _read_json(path: Path, required_fields: Sequence[str], check: RowCheck | None = None) -> list[dict]:
    """Rows of a JSON file holding a list of objects or {"data": [...]}."""
    expected = 'a list of row objects or {"data": [...]}'
    data = parse_json(path.read_bytes(), str(path), expected)
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise UserError(f"{path}: expected {expected}")
    return [_check_row(row, required_fields, f"{path}: item {i}", check) for i, row in enumerate(data, 1)]


def _read_parquet(path: Path, required_fields: Sequence[str], check: RowCheck | None = None) -> list[dict]:
    """Rows of a parquet file, via pyarrow (or pandas) when one is installed."""
    try:
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    except ImportError:
        try:
            import pandas as pd
        except ImportError as exc:
            raise UserError(
                f"{path}: reading .parquet needs pyarrow or pandas, neither is installed; "
                "convert the file to .jsonl or install pyarrow"
            ) from exc
        rows = pd.read_parquet(path).to_dict(orient="records")
    return [_check_row(row, required_fields, f"{path}: row {i}", check) for i, row in enumerate(rows, 1)]


def read_rows(path: str | Path, required_fields: Sequence[str] = (), check: RowCheck | None = None) -> list[dict]:
    """Rows of a local `.jsonl`, `.json` or `.parquet` file, each checked for `required_fields` and by `check`."""
    p = check_regular_file(path, "data file", f"a {', '.join(LOCAL_SUFFIXES)} file")
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    reader = readers.get(p.suffix.lower())
    if reader is None:
        raise UserError(f"{p}: unsupported file type {p.suffix!r}, expected one of {LOCAL_SUFFIXES}")
    return reader(p, required_fields, check)


def resolve_local(path: str | Path, split: str) -> Path:
    """A data file: `path` itself, or `<path>/<split>.{jsonl,json,parquet}` when `path` is a folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        for suffix in LOCAL_SUFFIXES:
            candidate = p / f"{split}{suffix}"
            if candidate.is_file():
                return candidate
        raise MissingFile(f"folder {p} has no {split}.jsonl, {split}.json or {split}.parquet")
    return p


class HubUnavailable(UserError, RuntimeError):
    """A data set could not be read from the Hugging Face hub (not installed, offline, unknown id)."""


def load_rows(
    path: str | Path,
    split: str,
    required_fields: Sequence[str],
    hub_config: str | None = None,
    check: RowCheck | None = None,
) -> list[dict]:
    """Rows from a local file/folder, or else from the Hugging Face hub via `datasets`, each checked by `check`.

    The hub is tried only when `path` does not look local; `datasets` is imported lazily and any
    failure (not installed, offline, unknown id) becomes a HubUnavailable error suggesting a local file.
    """
    if is_local_source(path):
        return read_rows(resolve_local(path, split), required_fields, check)
    try:
        import datasets
    except ImportError as exc:
        raise HubUnavailable(
            f"{path!r} is not a local file and the 'datasets' package is not installed: "
            "pip install 'bridgelm[hub]' to read it from the Hugging Face hub, or pass a local .jsonl/.json/.parquet path"
        ) from exc
    try:
        ds = datasets.load_dataset(str(path), hub_config, split=split)
    except Exception as exc:  # offline, unknown id, missing split: all mean "use a local file"
        raise HubUnavailable(
            f"could not load {path!r} (split {split!r}) from the Hugging Face hub: "
            f"{type(exc).__name__}: {exc}; pass a local .jsonl/.json/.parquet path instead"
        ) from exc
    return [_check_row(dict(row), required_fields, f"{path}[{split}] row {i}", check) for i, row in enumerate(ds, 1)]
