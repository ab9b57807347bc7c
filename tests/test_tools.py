"""Tools: the calculator against Python's own arithmetic, hostile inputs refused fast, the python
tool's limits, user tools and the call finder."""
import fractions
import time

import pytest

from megarl.rollout.tools import (Calculator, FunctionTool, PythonTool, Toolbox, ToolError, build_tools, calculate,
                                  format_number)
from test_tool_sandbox import needs_bwrap

TABLE = ["48/2", "48+24", "12/60", "0.2*50", "100/2", "2**10", "-(3+4)*2", "7//2", "-7//2", "7%3", "-7%3",
         "2**-2", "(1+2)*(3+4)", "1,000*3", " 3 + 4 ", "2**0.5", "10/4", "1e3+1", "+5", "123456789*987654321",
         "3.5%2", "2**332", "(((((1)))))"]


@pytest.mark.parametrize("expr", TABLE)
def test_calculator_agrees_with_python(expr):
    want = compile(expr.replace(",", "").strip(), "<table>", "eval")  # the test's reference is Python itself
    value = eval(want, {"__builtins__": {}})  # noqa: S307 - trusted table above
    assert calculate(expr) == format_number(value)


def test_calculator_formats_like_gsm8k():
    assert calculate("48/2") == "24" and calculate("12/60") == "0.2" and calculate("10/3") == "3.333333333"
    assert calculate("123456789*987654321") == str(123456789 * 987654321)
    assert Calculator().call("48/2").text == "24>>"
    assert fractions.Fraction(calculate("1/8")) == fractions.Fraction(1, 8)


HOSTILE = ["9**9**9", "10**1000000", "2**100000000", "(-9)**(9**9)", "1" * 10 ** 6, "(" * 5000 + "1" + ")" * 5000,
           "-" * 10**5 + "1", "().__class__", "(1).real", "x", "x+1", "__import__('os').system('true')",
           "open('/etc/passwd')", "[1]*10**9", "'a'*10**9", "lambda: 1", "1 if 1 else 2", "1<2", "1/0", "0**-1",
           "5%0", "1e308*10", "1.5**100000", "(-8)**0.5", "", "   ", "1+", "1;2", "a=1", "10**99*10**99",
           "9"*99 + "*" + "9"*99, "1j", "True+1", "b'1'", "...", "{1:2}"]


@pytest.mark.parametrize("expr", HOSTILE)
def test_calculator_refuses_hostile_input_fast(expr):
    result = Calculator().call(expr)  # a runaway computation would come back as status "timeout"
    assert result.status == "error" and result.text.startswith("error: ") and result.text.endswith(">>"), result
    # "fast" is counted in this thread's CPU seconds, not wall seconds: CI shares the machine, and a
    # wall clock once read 591 ms for `1j` (0.4 ms when quiet); 9**9**9 evaluated would take minutes
    cpu0 = time.thread_time()
    with pytest.raises(ToolError):
        calculate(expr)
    cpu_s = time.thread_time() - cpu0
    assert cpu_s < 0.05, f"{expr[:40]!r} took {cpu_s * 1e3:.1f} ms of CPU"


def test_output_cap_and_exceptions_become_observations():
    tool = FunctionTool(lambda s: s * 100, name="echo", max_output_chars=10)
    r = tool.call("ab")
    assert r.status == "ok" and r.text == "<output>abababababab</output>"[:8] + "ababababab</output>"

    def boom(arg):
        raise KeyError(arg)

    r = FunctionTool(boom).call("k")
    assert r.status == "error" and r.text == "<output>error: KeyError: 'k'</output>"

    def slow(arg):
        time.sleep(5)

    t0 = time.perf_counter()
    r = FunctionTool(slow, timeout_s=0.1).call("")
    assert r.status == "timeout" and "timed out after 0.1s" in r.text and time.perf_counter() - t0 < 1


def test_find_call_protocol():
    box = Toolbox([Calculator(), FunctionTool(str.upper, name="up")], max_calls=2)
    assert box.find_call("so 48/2 = <<48/2") is None
    call = box.find_call("so 48/2 = <<48/2=")
    assert call.tool.name == "calculator" and call.argument == "48/2" and call.end == len("so 48/2 = <<48/2=")
    assert box.find_call("3+4=7, <<1+<<2*3=").argument == "2*3"  # the innermost open before the close
    assert box.find_call("<up>hi</up> then <<1=").tool.name == "up"  # the first call closed wins
    assert box.find_call("=<<") is None
    assert box.find_call("5<<=").argument == ""  # an empty call: its argument is empty, not the open marker
    assert box.find_call("<up></up>").argument == "" and box.find_call("a<<<<b=").argument == "b"
    with pytest.raises(ValueError, match="overlap"):
        Toolbox([Calculator(), FunctionTool(str.upper, name="<x")])


def test_build_tools_specs(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text("def shout(s):\n    return s.upper()\nNOT_CALLABLE = 3\n")
    tools = build_tools(["calculator", f"{path}:shout"], timeout_s=1.0, max_output_chars=50)
    assert [t.name for t in tools] == ["calculator", "shout"] and tools[1].call("a").text == "<output>A</output>"
    assert tools[0].timeout_s == 1.0 and tools[1].max_output_chars == 50
    for spec, msg in [("python", "enable it explicitly"), ("nope", "unknown tool 'nope'"),
                      (f"{path}:missing", "has no attribute 'missing'"), (f"{path}:NOT_CALLABLE", "is not callable"),
                      ("no_such_module_xyz:f", "cannot import"), ("", "built-in name")]:
        with pytest.raises(ValueError, match=msg):
            build_tools([spec])
    with pytest.raises(ValueError, match="clashing names"):
        build_tools(["calculator", "calculator"])


@needs_bwrap
def test_build_python_tool():
    assert [t.name for t in build_tools(["python"], python=True)] == ["python"]


# ------------------------------------------------------------------ python tool

@pytest.fixture(scope="module", params=[pytest.param("sandboxed", marks=needs_bwrap)])
def python_tool():
    return PythonTool(timeout_s=2.0, max_output_chars=200, memory_mb=256)


def test_python_tool_runs_code(python_tool):
    r = python_tool.call("import math\nprint(math.factorial(10))")
    assert r.status == "ok" and r.text == "<output>3628800\n</output>"
    r = python_tool.call("print('partial')\nraise ValueError('bad input')")
    assert r.status == "error" and r.text == "<output>partial\nerror: ValueError: bad input</output>"


@pytest.mark.parametrize("name,code,status,needle", [
    ("while True", "while True:\n    pass", "timeout", "timed out after 2s"),
    ("10 GiB", "x = bytearray(10 * 2**30)\nprint(len(x))", "error", "MemoryError"),
    ("fork bomb", "import os\nwhile True:\n    os.fork()", "error", "os.fork is not allowed"),
    ("subprocess", "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])", "error", "not allowed"),
    ("network", "import socket\ns = socket.create_connection(('1.1.1.1', 80), timeout=1)\nprint('connected')",
     "error", "not allowed"),
    ("huge output", "print('x' * 10**7)", "error", "File too large"),  # 10 MB against a 64 KiB cap
    ("sleep", "import time\ntime.sleep(60)", "timeout", "timed out"),
])
def test_python_tool_limits(python_tool, name, code, status, needle):
    t0 = time.perf_counter()
    r = python_tool.call(code)
    elapsed = time.perf_counter() - t0
    assert r.status == status and needle in r.text, (name, r)
    assert "connected" not in r.text and len(r.text) <= 200 + len("<output></output>")
    assert elapsed < python_tool.timeout_s + 1.0, f"{name} took {elapsed:.1f}s"


# ------------------------------------------------------------------ config and evaluation


def test_config_tool_fields_validated_one_line_each(tmp_path):
    from megarl.config import check_config, load_config
    from megarl.rollout.tools import make_toolbox

    cfg = load_config(None, ["rl.tools=[calculator]", "rl.max_tool_calls=2", "rl.tool_timeout_s=0.5"])
    assert check_config(cfg, 1, stage="rl") == []
    box = make_toolbox(cfg.rl.tools, max_calls=cfg.rl.max_tool_calls, timeout_s=cfg.rl.tool_timeout_s,
                       max_output_chars=cfg.rl.tool_max_output_chars, python=cfg.rl.python_tool)
    assert box.max_calls == 2 and box.tools[0].timeout_s == 0.5 and make_toolbox([], max_calls=1, timeout_s=1,
                                                                                   max_output_chars=1) is None
    bad = load_config(None, ["rl.tools=[calculator, python, nope, calculator, missing.py:f]", "rl.max_tool_calls=0",
                             "rl.tool_timeout_s=-1", "rl.tool_max_output_chars=0"])
    errs = [e for e in check_config(bad, 1, stage="rl") if "tool" in e]
    assert errs == [
        "rl.tools has python, which runs model-written code: set rl.python_tool=true to allow it",
        "rl.tools[2] is 'nope': expected a built-in (calculator, python) or 'module:function'",
        "rl.tools[4] is 'missing.py:f': file not found: missing.py",
        "rl.tools lists a tool twice: ['calculator', 'python', 'nope', 'calculator', 'missing.py:f']",
        "rl.max_tool_calls must be >= 1, got 0",
        "rl.tool_timeout_s must be in (0, 3600] seconds, got -1.0",
        "rl.tool_max_output_chars must be >= 1, got 0",
    ]
    assert check_config(load_config(None, ["rl.tools=[python]", "rl.python_tool=true"]), 1, stage="rl") == []


def test_eval_reports_tool_metrics(monkeypatch):
    """pass@k with a tool-using engine: the tool metrics are the rollouts' own counts, averaged."""
    from types import SimpleNamespace

    import torch
    from megatron.core import parallel_state as ps

    from megarl.trainers.evaluate import pass_at_k_eval

    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda: 0)
    k, n = 2, 3
    calls = torch.tensor([0, 1, 2, 3, 1, 0])
    errors = torch.tensor([0, 1, 0, 1, 0, 0])

    class Engine:
        tools = object()

        def generate(self, prompts, params, seed, sample_offset):
            return SimpleNamespace(responses=lambda: [[i] for i in range(n * k)], response_lens=torch.full((n * k,), 5),
                                   tool_calls=calls, tool_errors=errors, observation_tokens=calls * 3,
                                   hit_call_limit=calls == 3, tool_timeouts=torch.tensor([0, 1, 0, 0, 0, 0]))

    data = [{"prompt_ids": [1], "messages": [{"content": f"q{i}"}], "answer": "1"} for i in range(n)]
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: str(ids[0]))
    metrics, rows = pass_at_k_eval(Engine(), data, tok, n_prompts=n, k=k, params=SimpleNamespace(n=k), seed=0,
                                   reward_fn=lambda p, r, a: [float(int(x) % 2) for x in r])
    assert metrics["tool_calls_per_sample"] == pytest.approx(7 / 6)
    assert metrics["tool_errors_per_sample"] == pytest.approx(2 / 6)
    assert metrics["tool_call_success"] == pytest.approx(5 / 7)
    assert metrics["observation_tokens"] == pytest.approx(21 / 6)
    assert metrics["tool_call_limit_rows"] == pytest.approx(1 / 6)
    assert metrics["tool_timeouts_per_sample"] == pytest.approx(1 / 6)
    assert metrics["pass_at_1"] == pytest.approx(0.5) and [r["tool_calls"] for r in rows] == [0, 2, 1]
