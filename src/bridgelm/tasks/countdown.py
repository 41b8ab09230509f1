"""Countdown: combine given numbers with + - * / to reach a target (generated offline).

Design notes:
- Problems come from `reasoning_gym.create_dataset("countdown", size=..., seed=...)`, which is
  deterministic and needs no download. reasoning-gym seeds problem i with `seed + i`, so each split
  gets its own seed range (SPLIT_OFFSETS) and train/validation/test never share a problem seed.
- Grading never evaluates model text as code. reasoning-gym's own scorer calls sympy's
  `parse_expr`, which runs `eval`, so it is not used; instead the expression is parsed with `ast`
  and only numeric literals, + - * /, unary signs and parentheses are accepted, evaluated exactly
  with Fractions.
- Rules follow reasoning-gym's scorer (and TinyZero's): the multiset of literals must equal the
  given numbers, i.e. every number used exactly once. `use_all=False` relaxes this to "each at most
  once".
- The paper cites TinyZero for Countdown, so the default prompt is TinyZero's user message
  (examples/data_preprocess/countdown.py, without its base-model "Assistant: ... <think>" prefix, which
  a chat template or the model's own thinking replaces):

      Using the numbers [44, 19, 35], create an equation that equals 98. You can use basic arithmetic
      operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think>
      tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.

  `prompt_style="boxed"` asks for the expression within \boxed{} instead (DeepSeek-R1 style).
- Answer format: whichever comes last of the last `<answer>...</answer>` and the last `\boxed{}`;
  an `= target` tail is dropped. Checked against TinyZero's `compute_score` (verl/utils/reward_score/
  countdown.py): the same rule (every given number exactly once, value equal to the target; TinyZero
  compares floats within 1e-5, here Fractions exactly, which agree for these integer problems). Two
  differences, both lenient: TinyZero reads `<answer>` only on the response's last line, and scores
  "(1 + 2) / 3 = 1" as wrong where this grader keeps the left-hand side. TinyZero's 0.1 format reward is
  a training reward, not accuracy, and is not given.
- Rows: `numbers`/`target`, or TinyZero's data set layout `nums`/`target` (Jiayi-Pan/Countdown-Tasks-3to4,
  3-4 numbers). The offline reasoning-gym problems have 4-6 numbers and targets 100-999, so they are
  harder than TinyZero's; use a Countdown-Tasks-3to4 file for the paper's setting.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

from bridgelm.errors import UserError, check_choice, check_int
from bridgelm.tasks.answers import last_boxed
from bridgelm.tasks.base import Task, read_rows, resolve_local

# First problem seed of each split; splits are SPLIT_STRIDE seeds apart.
SPLIT_STRIDE = 10**9
SPLIT_OFFSETS = {"test": 0, "validation": SPLIT_STRIDE, "train": 2 * SPLIT_STRIDE}

# Longest expression considered (longer text is refused before parsing).
MAX_EXPRESSION_CHARS = 500

# Fields of a countdown row read from a local file (TinyZero's files call the numbers `nums`).
FIELDS = ("numbers", "target")

# Prompt wordings: TinyZero's (answer in <answer> tags) and DeepSeek-R1's (answer within \boxed{}).
PROMPT_STYLES = ("tinyzero", "boxed")

# LaTeX and unicode spellings of the four operations, mapped to Python syntax.
_OPERATOR_SPELLINGS = (
    ("\\times", "*"),
    ("\\cdot", "*"),
    ("\\div", "/"),
    ("×", "*"),
    ("÷", "/"),
    ("−", "-"),
    ("\\left", ""),
    ("\\right", ""),
    ("\\(", ""),
    ("\\)", ""),
    ("$", ""),
    ("\\!", ""),
    ("\\,", ""),
)

_BINARY_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def normalize_expression(text: str) -> str:
    """LaTeX-ish expression -> Python arithmetic: operators, `\\frac{a}{b}`, braces, `= target`."""
    s = text.strip()
    for latex, py in _OPERATOR_SPELLINGS:
        s = s.replace(latex, py)
    # \frac{a}{b} -> ((a)/(b)), innermost first.
    frac = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
    while frac.search(s):
        s = frac.sub(r"((\1)/(\2))", s)
    s = s.replace("{", "(").replace("}", ")").replace("[", "(").replace("]", ")")
    if "=" in s:
        s = s.split("=", 1)[0]  # "(a + b) * c = 24" -> the left-hand side
    return s.strip().rstrip(".").strip()


def _evaluate(node: ast.AST, literals: list[Fraction]) -> Fraction:
    """Exact value of an arithmetic AST; raises ValueError on anything but numbers and + - * /."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, literals)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = Fraction(node.value)
        literals.append(value)
        return value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left = _evaluate(node.left, literals)
        right = _evaluate(node.right, literals)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _BINARY_OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, literals)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"{type(node).__name__} is not allowed: expected numbers and + - * / only")


def check_expression(expression: str | None, numbers: list[int], target: int, use_all: bool = True) -> bool:
    """Does `expression` reach `target` using the given numbers (each exactly once / at most once)?"""
    if not expression:
        return False
    text = normalize_expression(expression)
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        return False
    try:
        tree = ast.parse(text, mode="eval")
        literals: list[Fraction] = []
        value = _evaluate(tree, literals)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError, ZeroDivisionError):
        return False
    used, given = Counter(literals), Counter(Fraction(n) for n in numbers)
    if use_all and used != given:
        return False
    if not use_all and any(used[v] > given[v] for v in used):
        return False
    return value == Fraction(target)


def extract_expression(completion: str) -> str | None:
    """The last `\\boxed{}` content or the last `<answer>...</answer>` (TinyZero style), whichever comes last."""
    text = completion or ""
    boxed = last_boxed(text)
    tags = list(re.finditer(r"<answer>\s*(.*?)\s*</answer>", text, flags=re.DOTALL))
    if boxed is not None and (not tags or max(text.rfind(cmd) for cmd in ("\\boxed", "\\fbox")) > tags[-1].start()):
        return boxed
    return tags[-1].group(1) if tags else None


@dataclass
class Countdown(Task):
    """Countdown problems with exact, eval-free grading."""

    several_answers: ClassVar[bool] = True  # many expressions reach a target
    use_all: bool = True  # every given number must be used exactly once (else: at most once)
    prompt_style: str = "tinyzero"  # "tinyzero": TinyZero's <answer> prompt; "boxed": \boxed{} (R1 style)

    def prompt(self, example: dict) -> str:
        if self.prompt_style == "tinyzero":
            return (
                f"Using the numbers {[int(n) for n in example['numbers']]}, create an equation that equals "
                f"{example['target']}. You can use basic arithmetic operations (+, -, *, /) and each number can "
                "only be used once. Show your work in <think> </think> tags. And return the final answer in "
                "<answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
            )
        numbers = ", ".join(str(n) for n in example["numbers"])
        rule = "exactly once" if self.use_all else "at most once"
        return (
            f"Using the numbers {numbers}, write an arithmetic expression that equals "
            f"{example['target']}. You may use +, -, * and / and parentheses, and each number must "
            f"be used {rule}.\nPlease reason step by step, and put your final expression (without "
            "'=' or the result) within \\boxed{}."
        )

    def answer(self, example: dict) -> str:
        return str(example.get("solution") or example["target"])

    def extract(self, completion: str) -> str | None:
        expression = extract_expression(completion)
        return normalize_expression(expression) if expression is not None else None

    def reward(self, completion: str, example: dict) -> float:
        ok = check_expression(extract_expression(completion), example["numbers"], example["target"], self.use_all)
        return 1.0 if ok else 0.0


def split_seed(split: str, seed: int, size: int) -> int:
    """The reasoning-gym seed of problems `seed .. seed + size` of `split` (splits never share a seed)."""
    check_choice("split", split, sorted(SPLIT_OFFSETS))
    check_int("size", size)
    if seed < 0 or seed + size > SPLIT_STRIDE:
        raise UserError(f"seed={seed} and size={size} must satisfy 0 <= seed, seed + size <= {SPLIT_STRIDE}")
    return SPLIT_OFFSETS[split] + seed


def make_problems(size: int, seed: int = 0, split: str = "test") -> list[dict]:
    """`size` problems from reasoning-gym, with seeds reserved for `split`."""
    import reasoning_gym  # heavy import, only when generating

    dataset = reasoning_gym.create_dataset("countdown", size=size, seed=split_seed(split, seed, size))
    examples = []
    for entry in dataset:
        meta = entry["metadata"]
        examples.append(
            {
                "numbers": list(meta["numbers"]),
                "target": int(meta["target"]),
                "solution": entry["answer"],
                "entry": entry,
            }
        )
    return examples


def _with_numbers(rows: list[dict], source: str) -> list[dict]:
    """Rows with `numbers`: TinyZero's `nums` is copied to it; a row with neither is a ValueError."""
    out = []
    for i, row in enumerate(rows, 1):
        if "numbers" not in row:
            if "nums" not in row:
                raise UserError(
                    f"{source}: row {i}: missing field 'numbers' (expected fields: numbers, target; or nums, target)"
                )
            row = {**row, "numbers": list(row["nums"])}
        out.append(row)
    return out


def check_row(row: dict) -> None:
    """ValueError unless `numbers` is a non-empty list of integers and `target` an integer."""
    numbers, target = row["numbers"], row["target"]
    if not isinstance(numbers, list) or not numbers or not all(_is_int(n) for n in numbers):
        raise ValueError(f"field 'numbers' is {numbers!r}: expected a non-empty list of integers")
    if not _is_int(target):
        raise ValueError(f"field 'target' is {target!r}: expected an integer")


def _check_either_layout(row: dict) -> None:
    """`check_row` of a row in our layout (numbers) or TinyZero's (nums); a row with neither fails later."""
    if "numbers" in row or "nums" in row:
        check_row({"numbers": row.get("numbers", row.get("nums")), "target": row["target"]})


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load(
    path: str | None = None,
    split: str = "test",
    size: int = 500,
    seed: int = 0,
    use_all: bool = True,
    prompt_style: str = "tinyzero",
) -> Countdown:
    """Countdown problems: generated offline (path None) or read from a local file of rows with
    `numbers` (or TinyZero's `nums`) and `target`."""
    if prompt_style not in PROMPT_STYLES:
        raise UserError(f"prompt_style={prompt_style!r} is unknown: expected one of {', '.join(PROMPT_STYLES)}")
    if path is None:
        examples = make_problems(size, seed=seed, split=split)
    else:
        rows = read_rows(resolve_local(path, split), ("target",), check=_check_either_layout)
        examples = _with_numbers(rows, str(path))
    return Countdown(name="countdown", examples=examples, use_all=use_all, prompt_style=prompt_style)
