"""Hostile programs for the python tool and the observation each must come to
(tests/test_tool_sandbox.py). As a script, `python sandbox_escapes.py ROOT` runs them with the
megarl tree at ROOT and prints the observations as JSON: the test runs it as uid 65534 when the
test itself runs as root, so that both ways bwrap starts are tried.

Most programs first replace `sys.audit`, the Python-level call through which `subprocess` raises
its audit event: the `_posixsubprocess.fork_exec` under it raises none. That gets past the
bootstrap's hook, as a determined program would, so only the sandbox stands in the way.
"""
import json
import os
import sys
import threading
import uuid

TIMEOUT_S = 8.0  # the wall clock of the escape that times out, time enough for its child to start
BYPASS = "import os, subprocess, sys, time\nsys.audit = lambda *a: None\n"
# a setsid'd child that announces itself in /tmp and would sleep for a minute; MARKER (in its
# argv) lets the test find it among the host's processes after the call
CHILD = ("subprocess.Popen([sys.executable, '-c', 'import time; open(\"/tmp/up\", \"w\").close(); time.sleep(60)',"
         " 'MARKER'], start_new_session=True)\n"
         "while not os.path.exists('/tmp/up'):\n    time.sleep(0.01)\nprint('child up', flush=True)\n")


def escapes(host_dir: str) -> list[tuple[str, str, str, str]]:
    """(name, program, status, text the observation must contain); host_dir: a directory of the
    host that the program must neither see nor write."""
    inner = ("import os, socket\n"
             f"print(os.getuid(), os.getgid(), os.path.exists('/etc/shadow'), os.path.exists({host_dir!r}))\n"
             "socket.create_connection(('1.1.1.1', 80), timeout=2)\n")
    return [
        ("read /etc/shadow", "print(open('/etc/shadow').read())", "error",
         "error: FileNotFoundError: [Errno 2] No such file or directory: '/etc/shadow'"),
        ("write the host dir", f"open({os.path.join(host_dir, 'escaped')!r}, 'w').write('x')", "error",
         "error: FileNotFoundError"),
        ("write /usr/lib", "open('/usr/lib/escaped', 'w').write('x')", "error", "'/usr/lib/escaped'"),
        ("write /", "open('/escaped', 'w').write('x')", "error", "Read-only file system"),
        ("write /tmp", "open('/tmp/ok', 'w').write('x')\nprint(open('/tmp/ok').read())", "ok", "<output>x\n</output>"),
        ("fork_exec /usr/bin/id", BYPASS + "subprocess.run(['/usr/bin/id'])", "error",
         "error: FileNotFoundError: [Errno 2] No such file or directory: '/usr/bin/id'"),
        ("os.system id", "import os\nprint(os.system('/usr/bin/id'))", "error", "os.system is not allowed"),
        ("an interpreter without the hook", BYPASS + f"r = subprocess.run([sys.executable, '-c', {inner!r}], "
         "capture_output=True, text=True)\nprint(r.stdout, end='')\nraise SystemExit(r.stderr.splitlines()[-1])",
         "error", "65534 65534 False False\nerror: OSError: [Errno 101] Network is unreachable"),
        # the parent lives on a while, so that the host's /proc scan sees its child during the call
        ("setsid child", BYPASS + CHILD + "time.sleep(2)\n", "ok", "<output>child up\n</output>"),
        ("setsid child, timeout", BYPASS + CHILD + "time.sleep(60)\n", "timeout",
         f"error: timed out after {TIMEOUT_S:g}s"),
    ]


def pids_with(marker: str) -> list[int]:
    """The host's processes with `marker` in their command line."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:  # it ended while we looked
            pass
    return found


def observe(host_dir: str) -> list[dict]:
    """Each escape through a PythonTool: `survivors`, its processes still alive after the call;
    `seen`, whether its marked child was alive during the call (so that the check means something).
    The wall clocks are generous: the programs end by themselves, but the CI machine may be busy."""
    from megarl.rollout.tools import PythonTool

    tool, slow = PythonTool(timeout_s=30.0, max_output_chars=400), PythonTool(timeout_s=TIMEOUT_S, max_output_chars=400)
    out = []
    for name, code, status, _ in escapes(host_dir):
        marker = f"megarl-escape-{uuid.uuid4().hex}"
        seen, done = [], threading.Event()
        watcher = threading.Thread(target=lambda: seen.append(_wait_for(marker, done)), daemon=True)
        watcher.start()
        r = (slow if status == "timeout" else tool).call(code.replace("MARKER", marker))
        done.set()
        watcher.join()
        out.append({"name": name, "status": r.status, "text": r.text, "survivors": pids_with(marker),
                    "seen": seen[0], "caller_uid": os.getuid()})
    return out


def _wait_for(marker: str, done: threading.Event) -> bool:
    while not done.is_set():
        if pids_with(marker):
            return True
        done.wait(0.05)
    return False


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    print(json.dumps(observe(os.path.dirname(os.path.abspath(__file__)))))
