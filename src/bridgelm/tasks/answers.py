"""Answer extraction shared by the tasks.

Design: completions are free text written by a model, so every helper here is total (returns None
instead of raising) and purely lexical (regexes and a brace scanner, never eval). Numbers are kept
as their cleaned decimal text as long as possible so that callers can choose between exact
(Decimal) and float comparison.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Commands that wrap a final answer; \fbox is what some models write instead of \boxed.
_BOX_COMMANDS = ("\\boxed", "\\fbox")

# A plain decimal number after cleaning: optional sign, digits with an optional fraction, or a bare
# fraction like ".5", optional exponent.
_NUMBER_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")

# Thousands separators: "1,234" or "12,345,678.5" (a comma list like "1,2" is not a number).
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")

# A number as it appears inside running text, with optional thousands separators.
# A minus sign counts only when it is not a binary minus ("10-3" is 10 and 3, "-3" is -3).
_NUMBER_IN_TEXT_RE = re.compile(r"(?:(?<![\w).])-)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")

# Decorations that can surround a number without changing it.
_NUMBER_NOISE = ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "{,}", "\\ ", "~")


def last_boxed(text: str | None) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` in `text`, or None.

    Braces are matched by counting, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`. The brace-less
    form `\\boxed 5` gives the following token. An unclosed box gives None.
    """
    if not text:
        return None
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        if i == start + len(cmd):
            return None  # "\boxedx" is another command, not a box
        # "\boxed 5": the token up to the next whitespace or '$'.
        token = re.match(r"[^\s$]+", text[i:])
        return token.group(0) if token else None
    depth = 0
    for j in range(i, len(text)):
        ch = text[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def _strip_text_commands(s: str) -> str:
    """Drop `\\text{...}`/`\\mbox{...}` unit annotations ("18 \\text{ dollars}" -> "18 ")."""
    return re.sub(r"\\(?:text|mbox|mathrm|textbf)\{[^{}]*\}", " ", s)


def number_text(s: str | None) -> str | None:
    """Cleaned decimal text of `s` if `s` is a single number, else None.

    Ignores `$`, `\\$`, percent signs, LaTeX thin spaces, surrounding whitespace, unit text in
    `\\text{}`, a trailing period and thousands separators ("1,234.50" -> "1234.50").
    """
    if s is None:
        return None
    s = _strip_text_commands(s)
    for noise in _NUMBER_NOISE:
        s = s.replace(noise, "")
    s = s.strip().rstrip(".").strip()
    if s.startswith("{") and s.endswith("}"):
        s = s[1:-1].strip()
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    s = s.replace(" ", "")
    return s if _NUMBER_RE.fullmatch(s) else None


def parse_number(s: str | None) -> float | None:
    """`s` as a float if it is a single number (see `number_text` for what is ignored), else None."""
    text = number_text(s)
    return float(text) if text is not None else None


def canonical_number(s: str | None) -> str | None:
    """Canonical decimal string of a number, exact: "1,000" -> "1000", "2.50" -> "2.5", "3.0" -> "3".

    Returns None when `s` is not a single number.
    """
    text = number_text(s)
    if text is None:
        return None
    try:
        value = Decimal(text)  # exact, whatever the context's precision; an exponent past MAX_EMAX is refused
    except InvalidOperation:
        return None
    return exact_text(value)


# Numbers whose plain form would need more digits than this are written in scientific form ("1e400").
PLAIN_DIGITS = 40


def exact_text(value: Decimal) -> str:
    """The one text of a finite Decimal's value, exact and short: no trailing zeros, no context rounding, no overflow
    ("2.50" -> "2.5", "1000", "0.05", "-3", "1e400", "1.5e-60"); every zero is "0"."""
    sign, digit_tuple, exp = value.as_tuple()
    digits = "".join(map(str, digit_tuple)).lstrip("0")
    if not digits:
        return "0"  # also folds "-0" and "0.00"
    kept = digits.rstrip("0")
    exp += len(digits) - len(kept)
    minus = "-" if sign else ""
    if 0 <= exp and len(kept) + exp <= PLAIN_DIGITS:
        return minus + kept + "0" * exp
    if -PLAIN_DIGITS <= exp < 0:
        whole, frac = (kept[:exp], kept[exp:]) if len(kept) > -exp else ("0", kept.rjust(-exp, "0"))
        return f"{minus}{whole}.{frac}"
    mantissa = kept[0] + ("." + kept[1:] if len(kept) > 1 else "")
    return f"{minus}{mantissa}e{exp + len(kept) - 1}"


def last_number(text: str | None) -> str | None:
    """The last number written in running text, thousands separators removed ("1,234" -> "1234")."""
    if not text:
        return None
    matches = _NUMBER_IN_TEXT_RE.findall(text)
    return matches[-1].replace(",", "") if matches else None


# Where the sentence after a marker ends: a line's end, or a full stop that no digit follows ("3.5" goes on).
_SENTENCE_END_RE = re.compile(r"\n|\.(?!\d)")
# A sum written out: numbers (with $ and commas) joined by arithmetic operators, an operator between two operands.
_SUM_RE = re.compile(r"[\s\d.,$+\-*/x×·^()]*\d\s*[-+*/x×·^]\s*[\d($][\s\d.,$+\-*/x×·^()]*")
# What may stand before a result after "=": spaces, a dollar, markdown bold, an opening bracket or math delimiter.
_RESULT_LEAD = " $*({\\"


def _worked_result(sentence: str) -> re.Match | None:
    """The result of a sum the sentence opens with ("2 * 4 = 8 pens": 8; "7 + 1 = 8 = eight": 8), or None when it
    opens with anything else ("6 = 2 x 3", "15 because 20 - 5 = 15": the number after the marker is the answer)."""
    first, *rest = sentence.split("=")
    if not rest or not _SUM_RE.fullmatch(first.strip(" :")):
        return None
    result = None
    for part in rest:  # a chain of "=": each link a number (the last one the result) or a sum again
        value = part.lstrip(_RESULT_LEAD)
        found = _NUMBER_IN_TEXT_RE.match(value)
        if found is None or value[found.end() :].startswith("/"):  # "= 7/2": not one number
            break
        result = found
        if not _SUM_RE.fullmatch(part.strip(" $*")) and part.strip(" $*.") != found.group(0):
            break  # words after the number end the chain
    return result


def after_marker(text: str, marker_re: str) -> str | None:
    """The number following the last match of `marker_re` (e.g. "####") that a number follows, or None: the first
    one, or where the sentence after the marker opens with a sum worked out ("the answer is 2 * 4 = 8 pens."), its
    result."""
    for hit in reversed(list(re.finditer(marker_re, text, flags=re.IGNORECASE))):  # the last one with a number
        # Only look a short way ahead: "the answer is 18." and not a number three paragraphs later.
        tail = _strip_text_commands(text[hit.end() :].split("\n\n", 1)[0][:200]).replace("\\$", "$")
        found = _worked_result(_SENTENCE_END_RE.split(tail, maxsplit=1)[0]) or _NUMBER_IN_TEXT_RE.search(tail)
        if found:
            return found.group(0).replace(",", "")
    return None


def extract_number_answer(text: str | None, fallback: bool = True) -> str | None:
    """Final numeric answer of a GSM8K-style completion, as canonical decimal text.

    Order: the last `\\boxed{}` (the number in it, or its last number when it holds a small
    expression like "2 \\times 9 = 18"), then the last of `#### N` and "the answer is N", then (when `fallback`)
    the last number anywhere in the text.
    """
    if not text:
        return None
    boxed = last_boxed(text)
    if boxed is not None:
        direct = canonical_number(boxed)
        if direct is not None:
            return direct
        inner = last_number(_strip_text_commands(boxed))
        if inner is not None:
            return canonical_number(inner)
    found = after_marker(text, r"####|the\s+(?:final\s+)?answer\s+is\s*:?")  # the later of the two says it last
    if found is not None:
        return canonical_number(found)
    found = last_number(text) if fallback else None
    return canonical_number(found) if found is not None else None


def after_thinking(completion: str | None) -> str:
    """The part of a completion after its last `</think>` (R1-style reasoning models think first); the whole
    completion when it has none."""
    text = completion or ""
    return text.rsplit("</think>", 1)[1] if "</think>" in text else text
