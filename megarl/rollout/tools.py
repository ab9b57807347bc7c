"""Tools a policy may call inside its response, and the text protocol of a call.

The protocol is inline, in the response text itself (no extra chat turn), as in nanochat and
GSM8K. The model writes `call_open ARGUMENT call_close`; the rollout engine sees the closed call
in the row's decoded tail, runs the tool on ARGUMENT and injects `result_open RESULT result_close`
as *observation* tokens (forced, not sampled: no log-prob, no loss), then sampling resumes.

    calculator  model: `<<48/2=`                 observation: `24>>`        (GSM8K's `<<48/2=24>>`)
    python      model: `<python>print(1)</python>` observation: `<output>1\n</output>`
    user tool   model: `<NAME>arg</NAME>`          observation: `<output>...</output>`

A tool never raises into the rollout: an exception, a timeout or a refused input becomes an
observation `error: ...` (status "error" or "timeout"), so the model sees what went wrong and the
step goes on. Outputs are capped at `max_output_chars`.

`calculator` evaluates + - * / // % ** and parentheses on int/float literals by walking Python's
`ast` (never eval), with bounded input length, literal sizes, exponents and result sizes, so that
hostile input (`9**9**9`, deep nesting, names, attributes, `__import__`) is refused in well under a
millisecond. `python` (opt-in) runs code in a fresh interpreter in a bubblewrap sandbox: see PythonTool
and sandbox.py.
"""
from __future__ import annotations

import ast
import math
import operator
import threading
from dataclasses import dataclass
from typing import Callable

from megarl.rollout import sandbox
from megarl.utils.imports import import_user_module

__all__ = ["Tool", "ToolResult", "Toolbox", "Calculator", "PythonTool", "FunctionTool", "calculate",
           "build_tools", "make_toolbox", "BUILTIN_TOOLS", "ToolError"]

OK, ERROR, TIMEOUT = "ok", "error", "timeout"


class ToolError(Exception):
    """Raised by a tool for a refused or failed call: its message becomes the `error: ...` observation."""


@dataclass(frozen=True)
class ToolResult:
    text: str     # the observation text, result_open + output + result_close
    status: str   # "ok" | "error" | "timeout"


class Tool:
    """A named tool with its call markers. Subclasses implement `run(argument) -> output`
    (raise ToolError for a refused call); `call` wraps it with the timeout, the output cap and
    the error observation, and never raises."""

    name: str = ""
    call_open: str = ""
    call_close: str = ""
    result_open: str = ""
    result_close: str = ""

    def __init__(self, *, timeout_s: float = 5.0, max_output_chars: int = 256):
        if not timeout_s > 0:
            raise ValueError(f"tool {self.name!r}: timeout_s must be > 0, got {timeout_s}")
        if max_output_chars < 1:
            raise ValueError(f"tool {self.name!r}: max_output_chars must be >= 1, got {max_output_chars}")
        self.timeout_s, self.max_output_chars = float(timeout_s), int(max_output_chars)

    def run(self, argument: str) -> str:
        raise NotImplementedError

    def observation(self, output: str) -> str:
        return f"{self.result_open}{output[: self.max_output_chars]}{self.result_close}"

    def call(self, argument: str) -> ToolResult:
        """Run with the timeout (in a daemon thread: a tool that never returns is abandoned, not
        joined) and the output cap; every failure is an `error: ...` observation."""
        box: dict = {}

        def target():
            try:
                box["out"] = str(self.run(argument))
            except BaseException as e:  # noqa: BLE001 - any failure of a tool is an observation
                box["err"] = e

        worker = threading.Thread(target=target, name=f"megarl-tool-{self.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            return ToolResult(self.observation(f"error: timed out after {self.timeout_s:g}s"), TIMEOUT)
        if "err" in box:
            e = box["err"]
            if isinstance(e, _Timeout):
                return ToolResult(self.observation(f"error: {e}"), TIMEOUT)
            msg = str(e) if isinstance(e, ToolError) else f"{type(e).__name__}: {e}"
            return ToolResult(self.observation("error: " + " ".join(msg.split())), ERROR)
        return ToolResult(self.observation(box["out"]), OK)


class _Timeout(ToolError):
    """A tool's own time limit (e.g. the python subprocess' wall clock) was hit."""


# ------------------------------------------------------------------ calculator

MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 100  # |integer literal or result| < 10**MAX_DIGITS

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_INT_LIMIT = 10 ** MAX_DIGITS


def _bounded(x):
    if isinstance(x, complex):
        raise ToolError("result is not a real number")
    if isinstance(x, float) and not math.isfinite(x):
        raise ToolError("result is too large")
    if isinstance(x, int) and abs(x) >= _INT_LIMIT:
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    return x


def _power(base, exponent):
    """base ** exponent, refused before computing when the result would exceed the bounds."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log10(abs(base)) >= MAX_DIGITS:
            raise ToolError(f"result has more than {MAX_DIGITS} digits")
    elif isinstance(exponent, (int, float)) and abs(base) > 1 and abs(exponent) > 10_000:
        raise ToolError("exponent is too large")
    if isinstance(exponent, int) and exponent < 0:
        base = float(base)
    try:
        return pow(base, exponent)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("result is too large") from None


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result is too large") from None
    raise ToolError(f"unsupported expression: {type(node).__name__} (numbers and + - * / // % ** ( ) only)")


def format_number(x) -> str:
    """Integers as integers (GSM8K's `48/2=24`, not 24.0); other floats to 10 significant digits."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e16:
        return str(int(x))
    return f"{x:.10g}" if isinstance(x, float) else str(x)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression; ToolError for anything else or anything too big.
    Commas are dropped first (`1,000*3`), as nanochat does."""
    text = expression.replace(",", "").strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not text:
        raise ToolError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise ToolError("not an arithmetic expression") from None
    return format_number(_eval(tree))


class Calculator(Tool):
    name, call_open, call_close, result_open, result_close = "calculator", "<<", "=", "", ">>"

    def run(self, argument: str) -> str:
        return calculate(argument)


# ------------------------------------------------------------------ python (opt-in)

class PythonTool(Tool):
    """Runs the argument as a Python program in a fresh interpreter (`python -I -S`, stdlib only,
    empty environment) inside the sandbox of `megarl/rollout/sandbox.py`: uid 65534, its own PID,
    mount, network, IPC and UTS namespaces, only /tmp writable; RLIMIT_CPU (the timeout + 1 s),
    RLIMIT_AS (`memory_mb`), RLIMIT_FSIZE (stdout/stderr go to files, capped) and a wall clock.
    The observation is stdout, then `error: <last stderr line>` when the program failed.
    ValueError, one line, where the sandbox cannot run: there is no unsandboxed fallback."""

    name, call_open, call_close, result_open, result_close = "python", "<python>", "</python>", "<output>", "</output>"

    def __init__(self, *, timeout_s: float = 5.0, max_output_chars: int = 256, memory_mb: int = 512):
        super().__init__(timeout_s=timeout_s, max_output_chars=max_output_chars)
        self.memory_mb = int(memory_mb)
        reason = sandbox.unavailable()
        if reason:
            raise ValueError(reason)

    def call(self, argument: str) -> ToolResult:
        try:  # the sandbox has its own wall clock: no thread needed
            return ToolResult(self.observation(self.run(argument)), OK)
        except _Timeout as e:
            return ToolResult(self.observation(f"error: {e}"), TIMEOUT)
        except _ProgramFailed as e:
            head = e.stdout[: max(0, self.max_output_chars - len(str(e)) - 8)]
            if head and not head.endswith("\n"):
                head += "\n"
            return ToolResult(self.observation(f"{head}error: {e}"), ERROR)
        except Exception as e:  # noqa: BLE001
            msg = str(e) if isinstance(e, ToolError) else f"{type(e).__name__}: {e}"
            return ToolResult(self.observation("error: " + " ".join(msg.split())), ERROR)

    def run(self, argument: str) -> str:
        cap_bytes = 4 * self.max_output_chars + 64  # what is read back of stdout
        code, stdout, stderr = sandbox.run(argument, timeout_s=self.timeout_s, cpu_s=math.ceil(self.timeout_s) + 1,
                                           memory_bytes=self.memory_mb << 20, read_bytes=cap_bytes,
                                           file_bytes=cap_bytes + (64 << 10))  # room for a traceback's last line
        if code is None:
            raise _Timeout(f"timed out after {self.timeout_s:g}s")
        if code != 0:
            last = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "").strip()
            if code > 128 and not last:  # bwrap's status for a program killed by a signal
                last = f"killed by signal {code - 128} (CPU time, memory or output limit)"
            raise _ProgramFailed(stdout, last or f"exit status {code}")
        return stdout


class _ProgramFailed(ToolError):
    """The program exited non-zero: the observation is its stdout, then `error: <last stderr line>`."""

    def __init__(self, stdout: str, last: str):
        super().__init__(last)
        self.stdout = stdout


# ------------------------------------------------------------------ user tools


class FunctionTool(Tool):
    """A user function `fn(argument: str) -> str` as a tool with markers `<NAME>` ... `</NAME>`,
    observation `<output>...</output>`; NAME is the function's name."""

    result_open, result_close = "<output>", "</output>"

    def __init__(self, fn: Callable[[str], str], name: str | None = None, **limits):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "tool")
        self.call_open, self.call_close = f"<{self.name}>", f"</{self.name}>"
        super().__init__(**limits)

    def run(self, argument: str) -> str:
        return self.fn(argument)


def _load_attr(spec: str):
    """`module:attr` or `path/to/file.py:attr` -> the attribute; ValueError naming what is wrong."""
    module_name, _, attr = spec.rpartition(":")
    obj = import_user_module(module_name, f"tool {spec!r}", "megarl_user_tool_")
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"tool {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


BUILTIN_TOOLS = {"calculator": Calculator, "python": PythonTool}


def build_tools(specs, *, timeout_s: float = 5.0, max_output_chars: int = 256, python: bool = False) -> list[Tool]:
    """Tools from names (`calculator`, `python`) or `module:attr` specs, where attr is a Tool
    subclass, a Tool instance, or a function str -> str. The python tool needs python=True (it runs
    model-written code). ValueError, one line, naming the bad spec."""
    limits = dict(timeout_s=timeout_s, max_output_chars=max_output_chars)
    tools: list[Tool] = []
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"tool must be a built-in name ({', '.join(BUILTIN_TOOLS)}) or 'module:function', got {spec!r}")
        spec = spec.strip()
        if spec == "python" and not python:
            raise ValueError("the python tool runs model-written code: enable it explicitly (rl.python_tool=true)")
        if spec in BUILTIN_TOOLS:
            tools.append(BUILTIN_TOOLS[spec](**limits))
            continue
        if ":" not in spec or not all(spec.rpartition(":")[::2]):
            raise ValueError(f"unknown tool {spec!r}: expected a built-in ({', '.join(BUILTIN_TOOLS)}) or 'module:function'")
        obj = _load_attr(spec)
        if isinstance(obj, type) and issubclass(obj, Tool):
            tool = obj(**limits)
        elif isinstance(obj, Tool):
            tool = obj
        elif callable(obj):
            tool = FunctionTool(obj, **limits)
        else:
            raise ValueError(f"tool {spec!r} is not callable (it is a {type(obj).__name__})")
        if not (tool.name and tool.call_open and tool.call_close):
            raise ValueError(f"tool {spec!r} needs a name, call_open and call_close")
        tools.append(tool)
    Toolbox(tools)  # the markers must not clash
    return tools


# ------------------------------------------------------------------ finding and running calls


@dataclass(frozen=True)
class ToolCall:
    tool: Tool
    argument: str
    end: int  # index in the scanned text just after call_close


class Toolbox:
    """The tools of a rollout and its per-sample call limit; finds closed calls in text."""

    def __init__(self, tools, max_calls: int = 4):
        self.tools = list(tools)
        if max_calls < 0:
            raise ValueError(f"max_tool_calls must be >= 0, got {max_calls}")
        self.max_calls = int(max_calls)
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools have clashing names: {names}")
        opens = [t.call_open for t in self.tools]
        for i, a in enumerate(opens):
            for b in opens[i + 1:]:
                if a.startswith(b) or b.startswith(a):
                    raise ValueError(f"tools' call markers {a!r} and {b!r} overlap: a call would be ambiguous")
        self.tail_chars = max((len(t.call_close) for t in self.tools), default=0)

    def find_call(self, text: str) -> ToolCall | None:
        """The first closed call in `text` (the part of a response after the last observation):
        the first call_close that has a call_open before it; the argument is what lies between the
        last such call_open and that call_close."""
        best = None
        for tool in self.tools:
            start = text.find(tool.call_open)
            if start < 0:
                continue
            close = text.find(tool.call_close, start + len(tool.call_open))
            if close < 0 or (best is not None and close >= best[0]):
                continue
            open_at = text.rfind(tool.call_open, start, close)  # the last open wholly before the close
            best = (close, ToolCall(tool, text[open_at + len(tool.call_open): close], close + len(tool.call_close)))
        return best[1] if best else None

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Run calls concurrently (each tool applies its own timeout); results in order."""
        if len(calls) <= 1:
            return [c.tool.call(c.argument) for c in calls]
        results: list = [None] * len(calls)

        def one(i):
            results[i] = calls[i].tool.call(calls[i].argument)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()  # each call returns by its own timeout
        return results


def make_toolbox(specs, *, max_calls: int, timeout_s: float, max_output_chars: int, python: bool = False):
    """The rollout engine's Toolbox from the config's fields (rl.tools, rl.max_tool_calls,
    rl.tool_timeout_s, rl.tool_max_output_chars, rl.python_tool); None when no tools are named."""
    if not specs:
        return None
    tools = build_tools(specs, timeout_s=timeout_s, max_output_chars=max_output_chars, python=python)
    return Toolbox(tools, max_calls=max_calls)
