"""GSM8K-style answers: a solution ends with `#### n`; the rule reward compares n numerically.

Both the synthetic task and GSM8K use this one convention, so the same checker scores either.
"""
import re
from decimal import Decimal, InvalidOperation

# After the last `####`: an optional minus sign and dollar sign, then a number (commas allowed).
_FINAL = re.compile(r"^\s*(-)?\s*\$?\s*(\d[\d,]*(?:\.\d*)?|\.\d+)")


def canonical_number(text: str) -> str | None:
    """'1,000' -> '1000', '7.0' -> '7', '-0.50' -> '-0.5'; None if text does not start with a number."""
    m = _FINAL.match(text)
    if m is None:
        return None
    try:
        value = Decimal(m.group(2).replace(",", "").rstrip(".") or "0")
    except InvalidOperation:
        return None
    if m.group(1):
        value = -value
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


# Any number in free text: not glued to a word or a decimal point before it (so "x2" and "5-3"'s
# "-3" are not read as numbers), thousands separators only in groups of three ("1,2,3" is 1, 2, 3).
_ANY_NUMBER = re.compile(r"(?<![\w.])(-)?\$?(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")


def last_number(text: str) -> str | None:
    """The last number anywhere in text, canonicalised ('$1,000.' -> '1000'); None when there is none."""
    found = None
    for found in _ANY_NUMBER.finditer(text):
        pass
    if found is None:
        return None
    return canonical_number(("-" if found.group(1) else "") + found.group(2))


def extract_answer(text: str, *, fallback_last_number: bool = False) -> str | None:
    """The number after the last `####` in text, canonicalised; None when there is none.

    Strict by default on purpose: a response without `#### n` earns no reward, which teaches the
    format. fallback_last_number=True (GSM8K-style evaluation of models that do not use `####`)
    takes the last number in the text when there is no `#### n`.
    """
    head, sep, tail = text.rpartition("####")
    value = canonical_number(tail) if sep else None
    if value is None and fallback_last_number:
        return last_number(text)
    return value


def is_correct(text: str, answer: str | int | float, *, fallback_last_number: bool = False) -> bool:
    """Whether the response's final `#### n` (or, with the fallback, its last number) equals the answer.

    `answer` may be a bare number ("72", 72) or a full GSM8K solution ending in `#### 72`.
    """
    predicted = extract_answer(text, fallback_last_number=fallback_last_number)
    if predicted is None:
        return False
    gold = str(answer)
    gold = extract_answer(gold) if "####" in gold else canonical_number(gold)
    return gold is not None and predicted == gold
