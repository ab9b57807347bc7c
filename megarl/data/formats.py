"""Read JSONL datasets in the TRL / OpenRLHF conventions and normalise them to conversations.

Accepted records (one JSON object per line; blank lines are skipped, counted and named by line):
  SFT          {"messages": [{"role", "content"}, ...]}
               {"prompt": str|messages, "completion": str|messages}
               {"question": str, "answer": str}                       (GSM8K: answer is the solution)
  preferences  {"prompt": str|messages, "chosen": str|messages, "rejected": str|messages}
               {"chosen": messages, "rejected": messages}             (prompt inside the conversations)
  RL prompts   {"prompt": str|messages, "answer": str|number}         (answer optional)
               {"question": str, "answer": "... #### 72"}             (GSM8K: answer becomes "72")
               "a bare JSON string"                                   (a prompt without answer)
               a .txt file: one prompt per line

Every record becomes a list of {"role", "content"} messages, so the tokenizer sees one shape only.
Each record remembers its line number so that later problems (e.g. too long) still name file:line.
"""
import json
import os
from dataclasses import dataclass

from megarl.data.answers import extract_answer
from megarl.data.errors import DataError, RecordProblem, Report

ROLES = ("system", "user", "assistant")
Messages = list[dict]


@dataclass(frozen=True)
class SFTRecord:
    line: int
    messages: Messages        # contains at least one assistant turn


@dataclass(frozen=True)
class PreferenceRecord:
    line: int
    chosen: Messages          # full conversations, each ending with an assistant turn
    rejected: Messages


@dataclass(frozen=True)
class PromptRecord:
    line: int
    messages: Messages        # ends with a user turn; the policy writes the assistant turn
    answer: str | None        # reference answer for rule rewards, canonical number when numeric


# ---------------------------------------------------------------------------- field checks

def _type_name(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean",
            type(None): "null", int: "number", float: "number"}.get(type(value), type(value).__name__)


def _text(rec: dict, key: str) -> str:
    if key not in rec:
        raise RecordProblem("missing_field", f"missing field '{key}'")
    value = rec[key]
    if not isinstance(value, str):
        raise RecordProblem("wrong_type", f"field '{key}' must be a string, got {_type_name(value)}")
    if not value.strip():
        raise RecordProblem("empty_field", f"field '{key}' is empty")
    return value


def _messages(value, field: str) -> Messages:
    """Validate a message list; return clean {"role", "content"} copies (extra keys dropped)."""
    if not isinstance(value, list):
        raise RecordProblem("wrong_type", f"field '{field}' must be a string or a list of messages, "
                                          f"got {_type_name(value)}")
    if not value:
        raise RecordProblem("empty_field", f"field '{field}' is an empty list")
    out = []
    for i, msg in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise RecordProblem("wrong_type", f"{where} must be an object with 'role' and 'content', "
                                              f"got {_type_name(msg)}")
        for key in ("role", "content"):
            if key not in msg:
                raise RecordProblem("missing_field", f"{where} has no '{key}'")
        role, content = msg["role"], msg["content"]
        if not isinstance(role, str):
            raise RecordProblem("wrong_type", f"{where}.role must be a string, got {_type_name(role)}")
        if role not in ROLES:
            raise RecordProblem("unknown_role", f"{where} has unknown role {role!r} "
                                                f"(expected {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise RecordProblem("wrong_type", f"{where}.content must be a string, got {_type_name(content)}")
        if not content.strip():
            raise RecordProblem("empty_field", f"{where}.content is empty")
        out.append({"role": role, "content": content})
    return out


def _text_or_messages(rec: dict, key: str, role: str) -> Messages:
    """A field that is either a string (one `role` message) or a message list."""
    if key not in rec:
        raise RecordProblem("missing_field", f"missing field '{key}'")
    if isinstance(rec[key], str):
        return [{"role": role, "content": _text(rec, key)}]
    return _messages(rec[key], key)


def _assistant_only(msgs: Messages, field: str) -> Messages:
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            raise RecordProblem("bad_messages", f"{field}[{i}] must be an assistant message, got role {m['role']!r}")
    return msgs


def _ends_with(msgs: Messages, role: str, what: str) -> Messages:
    if msgs[-1]["role"] != role:
        article = "an" if role == "assistant" else "a"
        raise RecordProblem("bad_messages", f"{what} must end with {article} {role} message, "
                                            f"got {msgs[-1]['role']!r}")
    return msgs


def _conversation_rules(msgs: Messages, what: str) -> Messages:
    """A system message only first; at least one user turn (what a chat template expects)."""
    for i, m in enumerate(msgs):
        if m["role"] == "system" and i > 0:
            raise RecordProblem("bad_messages", f"{what}[{i}] is a system message; a system message may only come first")
    if not any(m["role"] == "user" for m in msgs):
        raise RecordProblem("bad_messages", f"{what} has no user message; a conversation needs at least one user turn")
    return msgs


# ---------------------------------------------------------------------------- record parsers

def parse_sft(rec: dict) -> Messages:
    if "messages" in rec:
        msgs = _messages(rec["messages"], "messages")
    elif "prompt" in rec or "completion" in rec:
        msgs = _text_or_messages(rec, "prompt", "user")
        msgs = msgs + _assistant_only(_text_or_messages(rec, "completion", "assistant"), "completion")
    elif "question" in rec:  # GSM8K: the worked solution (ending in #### n) is the completion
        msgs = [{"role": "user", "content": _text(rec, "question")},
                {"role": "assistant", "content": _text(rec, "answer")}]
    else:
        raise RecordProblem("missing_field", "missing field 'messages' "
                                             "(or 'prompt'+'completion', or GSM8K 'question'+'answer')")
    if not any(m["role"] == "assistant" for m in msgs):
        raise RecordProblem("bad_messages", "conversation has no assistant message to train on")
    return _conversation_rules(msgs, "messages")


def parse_preference(rec: dict) -> tuple[Messages, Messages]:
    chosen = _text_or_messages(rec, "chosen", "assistant")
    rejected = _text_or_messages(rec, "rejected", "assistant")
    if "prompt" in rec:
        prompt = _text_or_messages(rec, "prompt", "user")
        chosen = prompt + _assistant_only(chosen, "chosen")
        rejected = prompt + _assistant_only(rejected, "rejected")
    elif chosen[0]["role"] == "assistant" or rejected[0]["role"] == "assistant":
        raise RecordProblem("missing_field", "missing field 'prompt' "
                                             "(needed unless 'chosen'/'rejected' are full conversations)")
    chosen, rejected = _ends_with(chosen, "assistant", "chosen"), _ends_with(rejected, "assistant", "rejected")
    _conversation_rules(chosen, "chosen"), _conversation_rules(rejected, "rejected")
    if chosen == rejected:
        raise RecordProblem("identical_pair", "chosen and rejected are the same; the pair has no preference to learn")
    return chosen, rejected


def parse_prompt(rec: dict | str) -> tuple[Messages, str | None]:
    """An RL prompt record (or a bare JSON string: a prompt without answer) -> (messages, answer)."""
    if isinstance(rec, str):
        if not rec.strip():
            raise RecordProblem("empty_field", "prompt string is empty")
        return [{"role": "user", "content": rec}], None
    if "prompt" in rec:
        msgs = _text_or_messages(rec, "prompt", "user")
        answer = None
        if "answer" in rec and rec["answer"] is not None:
            value = rec["answer"]
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                raise RecordProblem("wrong_type", f"field 'answer' must be a string or number, "
                                                  f"got {_type_name(value)}")
            answer = str(value).strip()
            if not answer:
                raise RecordProblem("empty_field", "field 'answer' is empty")
            if "####" in answer:  # a full GSM8K-style solution: keep only the final number
                answer = extract_answer(answer)
                if answer is None:
                    raise RecordProblem("bad_answer", "field 'answer' has '####' but no number after it")
    elif "question" in rec:  # GSM8K
        msgs = [{"role": "user", "content": _text(rec, "question")}]
        answer = extract_answer(_text(rec, "answer"))
        if answer is None:
            raise RecordProblem("bad_answer", "GSM8K field 'answer' does not end with '#### <number>'")
    else:
        raise RecordProblem("missing_field", "missing field 'prompt' (or GSM8K 'question'+'answer')")
    return _ends_with(msgs, "user", "prompt"), answer


# ---------------------------------------------------------------------------- file readers

def iter_lines(path: str, report: Report):
    """Yield (line_number, text) for non-blank lines; count blank and non-UTF-8 lines in report."""
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path}")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # UTF-8 byte-order mark
            if not raw.strip():
                report.blank_line(lineno)
                continue
            report.records += 1
            try:
                yield lineno, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                report.problem(lineno, "invalid_utf8", f"not valid UTF-8 (byte {e.start})")


def iter_json_records(path: str, report: Report, strings: bool = False):
    """Yield (line_number, record) for each JSON object line (and JSON string line, with
    strings=True), applying the policy to bad lines."""
    types, what = ((dict, str), "a JSON object or string") if strings else (dict, "a JSON object")
    for lineno, text in iter_lines(path, report):
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            report.problem(lineno, "invalid_json", f"invalid JSON: {e.msg} (column {e.colno})")
            continue
        if not isinstance(rec, types):
            report.problem(lineno, "wrong_type", f"expected {what}, got {_type_name(rec)}")
            continue
        yield lineno, rec


def _read(path: str, report: Report, parse, make, strings: bool = False):
    out = []
    for lineno, rec in iter_json_records(path, report, strings):
        try:
            out.append(make(lineno, parse(rec)))
        except RecordProblem as p:
            report.problem(lineno, p.kind, str(p))
    return out


def read_sft(path: str, report: Report) -> list[SFTRecord]:
    return _read(path, report, parse_sft, lambda line, msgs: SFTRecord(line, msgs))


def read_preferences(path: str, report: Report) -> list[PreferenceRecord]:
    return _read(path, report, parse_preference, lambda line, cr: PreferenceRecord(line, *cr))


def read_prompts(path: str, report: Report) -> list[PromptRecord]:
    """RL prompts from JSONL (objects or bare JSON strings), or a .txt file with one prompt per line."""
    if str(path).endswith(".txt"):
        return [PromptRecord(lineno, [{"role": "user", "content": text}], None)
                for lineno, text in iter_lines(path, report)]
    return _read(path, report, parse_prompt, lambda line, pa: PromptRecord(line, *pa), strings=True)
