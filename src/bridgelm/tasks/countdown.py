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
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from bridgelm.tasks.answers import last_boxed
from bridgelm.tasks.base import Task, read_rows, resolve_local

# First problem seed of each split; splits are SPLIT_STRIDE seeds apart.
SPLIT_STRIDE = 10**9
SPLIT_OFFSETS = {"test": 0, "validation": SPLIT_STRIDE, "train": 2 * SPLIT_STRIDE}

# Longest expression considered (longer text is refused before parsing).
MAX_EXPRESSION_CHARS = 500

# Fields of a countdown row read from a local file.
FIELDS = ("numbers", "target")

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
    """The last `\\boxed{}` content, else the last `<answer>...</answer>` (reasoning-gym style)."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    tags = re.findall(r"<answer>\s*(.*?)\s*</answer>", completion or "", flags=re.DOTALL)
    return tags[-1] if tags else None


@dataclass
class Countdown(Task):
    """Countdown problems with exact, eval-free grading."""

    use_all: bool = True  # every given number must be used exactly once (else: at most once)

    def prompt(self, example: dict) -> str:
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


def generate(size: int, seed: int = 0, split: str = "test") -> list[dict]:
    """`size` problems from reasoning-gym, with seeds reserved for `split`."""
    if split not in SPLIT_OFFSETS:
        raise ValueError(f"split={split!r} is unknown: expected one of {sorted(SPLIT_OFFSETS)}")
    if size < 1:
        raise ValueError(f"size={size} must be >= 1")
    if seed < 0 or seed + size > SPLIT_STRIDE:
        raise ValueError(f"seed={seed} and size={size} must satisfy 0 <= seed, seed + size <= {SPLIT_STRIDE}")
    import reasoning_gym  # heavy import, only when generating

    dataset = reasoning_gym.create_dataset("countdown", size=size, seed=SPLIT_OFFSETS[split] + seed)
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


def check_row(row: dict) -> None:
    """ValueError unless `numbers` is a non-empty list of integers and `target` an integer."""
    numbers, target = row["numbers"], row["target"]
    if not isinstance(numbers, list) or not numbers or not all(_is_int(n) for n in numbers):
        raise ValueError(f"field 'numbers' is {numbers!r}: expected a non-empty list of integers")
    if not _is_int(target):
        raise ValueError(f"field 'target' is {target!r}: expected an integer")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load(
    path: str | None = None, split: str = "test", size: int = 500, seed: int = 0, use_all: bool = True
) -> Countdown:
    """Countdown problems: generated offline (path None) or read from a local file of rows with
    `numbers` and `target`."""
    if path is None:
        examples = generate(size, seed=seed, split=split)
    else:
        examples = read_rows(resolve_local(path, split), FIELDS, check=check_row)
    return Countdown(name="countdown", examples=examples, use_all=use_all)
