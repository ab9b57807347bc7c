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


def extract_answer(text: str) -> str | None:
    """The number after the last `####` in text, canonicalised; None when there is none.

    Strict on purpose: a response without `#### n` earns no reward, which teaches the format.
    """
    head, sep, tail = text.rpartition("####")
    if not sep:
        return None
    return canonical_number(tail)


def is_correct(text: str, answer: str | int | float) -> bool:
    """Whether the response's final `#### n` equals the reference answer numerically.

    `answer` may be a bare number ("72", 72) or a full GSM8K solution ending in `#### 72`.
    """
    predicted = extract_answer(text)
    if predicted is None:
        return False
    gold = str(answer)
    gold = extract_answer(gold) if "####" in gold else canonical_number(gold)
    return gold is not None and predicted == gold
