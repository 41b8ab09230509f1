"""ZebraLogic: logic-grid (zebra) puzzles, graded per puzzle (accuracy).

Two row layouts, told apart per row:
- reasoning-gym (`question`, `answer`): what the offline generator writes. With no path, problems come from
  `reasoning_gym.create_dataset("zebra_puzzles", size=..., seed=...)` (4 houses x 4 attributes by default,
  deterministic, no download; each split has its own seed range, as for countdown). The question asks for one
  cell (the name in a house). Prompt: the question + "Please reason step by step, and put your final answer
  within \\boxed{}." Answer format: the last `\\boxed{}` (`\\text{}` unwrapped), else the last
  `<answer>...</answer>`. Graded by reasoning-gym's own `score_answer` (case-insensitive equality).
- ZebraLogic grid mode (`id`, `size`, `puzzle`, `solution` = {`header`: ["House", attribute...], `rows`:
  [[house, value...], ...]}), the layout of allenai/ZebraLogicBench (config `grid_mode`). Prompt: the puzzle,
  then an instruction to present reasoning and the filled grid as JSON in the shape
  `{"reasoning": "___", "solution": {"House 1": {"<attribute>": "___", ...}, ...}}` (ZeroEval's format, without
  its one-shot example). Answer format: the last complete top-level JSON object of the completion (after its
  last `</think>`); its "solution" (or the object itself). A puzzle is solved when every cell matches,
  compared as ZeroEval does: lowercased and stripped, a list cell counted by its first entry.

    bridgelm eval --model M --task zebra --n 32 --width 8 --chat --out runs/zebra          (generated puzzles)
    bridgelm eval --model M --task zebra --data zebra_grid.parquet --n 32 --width 8 --chat --out runs/zebra
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from bridgelm.tasks.answers import after_thinking, last_boxed
from bridgelm.tasks.base import Task, load_rows, require_text, with_instruction
from bridgelm.tasks.countdown import split_seed

# Fields of the two row layouts.
GYM_FIELDS = ("question", "answer")
GRID_FIELDS = ("puzzle", "solution")

# Hub configuration of ZebraLogic files read through `datasets` (a hub id given as the path).
HUB_CONFIG = "grid_mode"

GRID_INSTRUCTION = (
    "Now please solve the above puzzle. Present your reasoning and solution in the following JSON format:"
)

_DECODER = json.JSONDecoder(strict=False)  # strict=False: raw newlines inside strings, as models write them


@lru_cache(maxsize=1)
def _gym_scorer():
    """A reasoning-gym zebra dataset, for its `score_answer`."""
    import reasoning_gym

    return reasoning_gym.create_dataset("zebra_puzzles", size=1, seed=0)


def is_grid(example: dict) -> bool:
    return "puzzle" in example and "solution" in example


def truth_table(solution: dict) -> dict[str, dict[str, str]]:
    """{"House i": {attribute: value}} of a grid-mode solution (header[0] is the house column)."""
    header = list(solution["header"])
    return {f"House {i}": dict(zip(header[1:], row[1:])) for i, row in enumerate(solution["rows"], 1)}


def last_json_object(text: str | None) -> dict | None:
    """The last complete top-level JSON object in `text` (a dict), or None."""
    text = text or ""
    found, at = None, text.find("{")
    while at != -1:
        try:
            obj, end = _DECODER.raw_decode(text, at)
        except ValueError:
            at = text.find("{", at + 1)
            continue
        if isinstance(obj, dict):
            found = obj
        at = text.find("{", end)  # objects nested in this one are not top-level
    return found


def _cell(value) -> str | None:
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None or isinstance(value, (dict, bool)):
        return None
    return str(value).strip().lower()


def _house_key(key: str) -> str:
    """ "house 1", "House_1", " HOUSE 1 " -> "House 1"."""
    m = re.fullmatch(r"\s*house[\s_]*(\d+)\s*", str(key), flags=re.IGNORECASE)
    return f"House {int(m.group(1))}" if m else str(key).strip()


def predicted_table(completion: str | None) -> dict[str, dict[str, str | None]] | None:
    """{"House i": {lowercased attribute: lowercased value}} from a completion's last JSON object, or None."""
    obj = last_json_object(after_thinking(completion))
    if obj is None:
        return None
    table = obj.get("solution", obj)
    if not isinstance(table, dict):
        return None
    out = {}
    for house, cells in table.items():
        if isinstance(cells, dict):
            out[_house_key(house)] = {str(k).strip().lower(): _cell(v) for k, v in cells.items()}
    return out or None


def grid_cells(completion: str | None, solution: dict) -> tuple[int, int]:
    """(correct cells, all cells) of a completion against a grid-mode solution."""
    truth = truth_table(solution)
    pred = predicted_table(completion) or {}
    total = sum(len(cells) for cells in truth.values())
    correct = 0
    for house, cells in truth.items():
        guess = pred.get(house, {})
        correct += sum(guess.get(attr.lower()) == str(value).strip().lower() for attr, value in cells.items())
    return correct, total


def extract_name(completion: str | None) -> str | None:
    """The answer of a reasoning-gym zebra question: last `\\boxed{}`, else last `<answer>` tag."""
    text = after_thinking(completion)
    boxed = last_boxed(text)
    if boxed is not None:
        unwrapped = re.fullmatch(r"\s*\\text(?:bf)?\{(.*)\}\s*", boxed)
        return (unwrapped.group(1) if unwrapped else boxed).strip()
    tags = re.findall(r"<answer>\s*(.*?)\s*</answer>", text, flags=re.DOTALL)
    return tags[-1].strip() if tags else None


@dataclass
class Zebra(Task):
    """Zebra puzzles: reasoning-gym questions or ZebraLogic grids; reward 1 for a solved puzzle."""

    def prompt(self, example: dict) -> str:
        if not is_grid(example):
            return with_instruction(example["question"])
        table = {house: {attr: "___" for attr in cells} for house, cells in truth_table(example["solution"]).items()}
        template = json.dumps({"reasoning": "___", "solution": table}, indent=4)
        return f"{str(example['puzzle']).strip()}\n\n{GRID_INSTRUCTION}\n\n{template}"

    def answer(self, example: dict) -> str:
        if not is_grid(example):
            return str(example["answer"])
        return json.dumps(truth_table(example["solution"]), sort_keys=True)

    def extract(self, completion: str) -> str | None:
        """The name (reasoning-gym rows) or the whole grid as canonical JSON (grid rows), for majority voting."""
        table = predicted_table(completion)
        if table is not None and any(table.values()):
            return json.dumps(table, sort_keys=True)
        return extract_name(completion)

    def reward(self, completion: str, example: dict) -> float:
        if not is_grid(example):
            return float(_gym_scorer().score_answer(extract_name(completion), {"answer": str(example["answer"])}))
        correct, total = grid_cells(completion, example["solution"])
        return 1.0 if correct == total else 0.0


def _is_list(x) -> bool:
    """A list as JSON gives it, or as a table reader may (a tuple, a numpy array)."""
    return isinstance(x, (list, tuple, np.ndarray))


def check_row(row: dict) -> None:
    """ValueError naming the field of a row that is neither a reasoning-gym question nor a ZebraLogic grid."""
    if is_grid(row):
        require_text(row, "puzzle")
        sol = row["solution"]
        if not isinstance(sol, dict) or "header" not in sol or "rows" not in sol:
            raise ValueError(f"solution {str(sol)[:80]!r}: expected {{'header': [...], 'rows': [[...]]}}")
        header, body = sol["header"], sol["rows"]
        if not (_is_list(header) and _is_list(body) and all(_is_list(r) for r in body)):
            raise ValueError(f"solution {str(sol)[:80]!r}: expected 'header' a list and 'rows' a list of lists")
        if len(header) < 2 or not body or any(len(r) != len(header) for r in body):
            raise ValueError(
                f"solution has header of {len(header)} columns and rows of lengths "
                f"{[len(r) for r in body]}: expected at least one row, each as long as the header (>= 2)"
            )
        cells = [*header, *(c for r in body for c in r)]
        if not all(isinstance(c, (str, int, np.integer)) and not isinstance(c, bool) for c in cells):
            raise ValueError(f"solution {str(sol)[:80]!r}: expected text (or numbers) in the header and the rows")
    elif all(f in row for f in GYM_FIELDS):
        require_text(row, "question")
        require_text(row, "answer")
    else:
        raise ValueError(
            f"has fields {sorted(row)}: expected {', '.join(GRID_FIELDS)} (ZebraLogic grid mode) "
            f"or {', '.join(GYM_FIELDS)} (reasoning-gym)"
        )


def make_problems(size: int, seed: int = 0, split: str = "test", **config) -> list[dict]:
    """`size` reasoning-gym zebra puzzles with seeds reserved for `split` (`config`: num_people, ...)."""
    first = split_seed(split, seed, size)
    import reasoning_gym  # heavy import, only when generating

    dataset = reasoning_gym.create_dataset("zebra_puzzles", size=size, seed=first, **config)
    return [{"question": e["question"], "answer": e["answer"], "metadata": e["metadata"]} for e in dataset]


def load(path: str | None = None, split: str = "test", size: int = 200, seed: int = 0) -> Zebra:
    """Zebra puzzles: generated offline (path None), or rows of a local file/folder or hub id in either layout."""
    if path is None:
        rows = make_problems(size, seed=seed, split=split)
    else:
        rows = load_rows(path, split, (), hub_config=HUB_CONFIG, check=check_row)
    return Zebra(name="zebra", examples=rows)
