"""Data errors and the fail/skip policy.

A user's data mistake must never end in a traceback: every problem becomes one line
`path:line: problem`. Under policy "fail" (default) the first problem raises DataError; under
"skip" each problem is counted by kind and the loader reports a one-line summary such as
`data/train.jsonl: kept 980 of 1000 records; skipped 12 too_long, 8 invalid_json; 3 blank lines`.
"""
from collections import Counter

POLICIES = ("fail", "skip")
_SHOWN_BLANK = 5  # blank line numbers listed in a summary

# The kinds of problem a record can have; the skip summary counts them under these names.
KINDS = (
    "invalid_utf8",   # the line is not UTF-8
    "invalid_json",   # the line does not parse as JSON
    "wrong_type",     # a field (or the record itself) has the wrong JSON type
    "missing_field",  # a required field is absent
    "empty_field",    # a required string is empty or whitespace only
    "unknown_role",   # a message role outside system/user/assistant
    "bad_messages",   # a conversation with the wrong shape (no user or assistant turn, a system
                      # message after the first, prompt ends with assistant)
    "identical_pair", # a preference pair whose chosen and rejected conversations are the same
    "bad_answer",     # a GSM8K answer without a final `#### n`
    "template_error", # the tokenizer's chat template refused the conversation
    "too_long",       # longer than seq_len after tokenisation
)


class DataError(ValueError):
    """A problem with the user's data or data settings; its message is one line, ready to print."""


class RecordProblem(Exception):
    """Raised inside a record parser; the loader turns it into a DataError or a skip count."""

    def __init__(self, kind: str, message: str):
        assert kind in KINDS, kind
        super().__init__(message)
        self.kind = kind


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise DataError(f"unknown bad-record policy {policy!r}: expected one of {', '.join(POLICIES)}")
    return policy


class Report:
    """Counts what happened to each line of one data file and applies the policy to problems."""

    def __init__(self, path: str, policy: str = "fail"):
        self.path = str(path)
        self.policy = check_policy(policy)
        self.records = 0          # non-blank lines seen
        self.blank = 0            # blank lines (skipped, but counted)
        self.blank_lines = []     # the first _SHOWN_BLANK of their line numbers, named in the summary
        self.skipped = Counter()  # kind -> count

    def problem(self, line: int, kind: str, message: str) -> None:
        """Record a bad record: raise under "fail", count under "skip"."""
        assert kind in KINDS, kind
        if self.policy == "fail":
            raise DataError(f"{self.path}:{line}: {message}") from None  # no chained traceback
        self.skipped[kind] += 1

    def blank_line(self, line: int) -> None:
        """Count a blank line (never an error, but reported by line number in the summary)."""
        self.blank += 1
        if len(self.blank_lines) < _SHOWN_BLANK:
            self.blank_lines.append(line)

    @property
    def kept(self) -> int:
        return self.records - sum(self.skipped.values())

    def summary(self) -> str:
        parts = [f"{self.path}: kept {self.kept} of {self.records} records"]
        if self.skipped:
            kinds = sorted(self.skipped.items(), key=lambda kv: (-kv[1], kv[0]))
            parts.append("skipped " + ", ".join(f"{n} {k}" for k, n in kinds))
        if self.blank:
            where = ", ".join(map(str, self.blank_lines)) + (", ..." if self.blank > len(self.blank_lines) else "")
            plural = "s" if self.blank != 1 else ""
            parts.append(f"{self.blank} blank line{plural}" + (f" (line{plural} {where})" if where else ""))
        return "; ".join(parts)

    @property
    def noteworthy(self) -> bool:
        """Whether the summary says something the user should see (skips or blank lines)."""
        return bool(self.skipped) or self.blank > 0

    def as_dict(self) -> dict:
        return {"path": self.path, "records": self.records, "kept": self.kept,
                "blank": self.blank, "skipped": dict(self.skipped)}
