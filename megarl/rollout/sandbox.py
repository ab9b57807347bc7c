"""The python tool's sandbox: a fresh interpreter inside bubblewrap (`bwrap`) namespaces.

The isolation is the kernel's, so it holds against code that gets past Python-level checks:
- the program runs as uid and gid 65534 ("nobody"), with no capabilities and no_new_privs;
- it has its own PID namespace: when the program exits or is killed, the kernel kills every
  process left in it, `setsid`'d ones included, before `run` returns;
- its own mount namespace: an empty read-only root with read-only binds of the shared libraries
  and this interpreter's prefix only (no /etc, /home, /usr/bin, run dir or checkout), and a
  private size-capped tmpfs at /tmp, its working directory and the one writable place. Host
  programs (`/usr/bin/id`, `sh`) are not there to start; the interpreter is, and it runs as the
  same unprivileged uid in the same namespaces;
- an empty network namespace, and IPC and UTS namespaces of its own;
- the resource limits the bootstrap sets: CPU seconds, address space, file size, processes.

bwrap as root creates the namespaces without a user namespace (one that root creates maps the
sandbox's uid back onto root outside), and the bootstrap becomes 65534 before the program's first
line; as any other user, bwrap maps that user to 65534 in a user namespace. Where bwrap is missing
or cannot create the namespaces, `unavailable()` says why in one line and the python tool is
refused; nothing runs unsandboxed.
"""
from __future__ import annotations

import functools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile

__all__ = ["NOBODY", "run", "unavailable"]

NOBODY = 65534  # the sandbox's uid and gid
TMP_BYTES = 16 << 20  # the size of the program's /tmp (RLIMIT_FSIZE caps each file in it further)
MIN_VERSION = (0, 8)  # --size, --perms on --tmpfs, --disable-userns
_LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32")

# Runs first in the sandbox, before the program: it leaves root when bwrap ran as root, sets the
# resource limits, and installs an audit hook that refuses new processes, ctypes and sockets with a
# readable message (the namespaces are the boundary; the hook only names what is refused).
_BOOTSTRAP = r"""
import os, resource, sys
nobody, cpu, mem, out = (int(a) for a in sys.argv[1:5])
if os.getuid() == 0:
    os.setgroups([])
    os.setresgid(nobody, nobody, nobody)
    os.setresuid(nobody, nobody, nobody)
if 0 in os.getresuid() + os.getresgid():
    raise SystemExit("the python tool does not run as root")
for lim, v in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, out),
               (resource.RLIMIT_NPROC, 64), (resource.RLIMIT_CORE, 0)):
    try:
        resource.setrlimit(lim, (v, v))
    except (ValueError, OSError):
        pass
_DENY = ("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "os.kill", "os.killpg",
         "subprocess.Popen", "pty.spawn", "ctypes.", "socket.", "os.setrlimit", "resource.setrlimit")
def _hook(event, args, _deny=_DENY):
    if event.startswith(_deny):
        raise PermissionError(f"{event} is not allowed in the python tool")
    if event == "import" and args and args[0] in ("_ctypes", "ctypes"):
        raise PermissionError(f"import {args[0]} is not allowed in the python tool")
sys.addaudithook(_hook)
del _hook, resource, nobody, cpu, mem, out
with open("main.py") as f:
    src = f.read()
exec(compile(src, "main.py", "exec"), {"__name__": "__main__"})
"""


def _mounts() -> tuple[str, list[str]]:
    """(the interpreter's real path, bwrap's mount arguments): read-only shared libraries and
    interpreter, /proc and /dev of the sandbox, and the private /tmp with the program in it."""
    made, bound, args = {"/"}, [], []

    def bind(path: str) -> None:  # its parents first, 0755: bwrap would make them 0700 (or copy /root's)
        if any(path.startswith(b + os.sep) for b in bound):
            return
        bound.append(path)
        parents, parent = [], os.path.dirname(path)
        while parent not in made:
            parents.append(parent)
            made.add(parent)
            parent = os.path.dirname(parent)
        for p in reversed(parents):
            args.extend(["--perms", "0755", "--dir", p])
        args.extend(["--ro-bind", path, path])

    for d in _LIB_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            bind(d)
    exe, prefix = os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
    # a /usr interpreter's stdlib is under /usr/lib, bound above; any other prefix (pyenv, conda,
    # /usr/local) is bound whole, at its own path: the interpreter may link its libpython by rpath
    for path in [exe] if prefix == "/usr" else [prefix] + ([] if exe.startswith(prefix + os.sep) else [exe]):
        bind(path)
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
    return exe, args


def _command(code_fd: int, info_fd: int, limits: list[str]) -> list[str]:
    """The bwrap command line that runs the bootstrap on the program read from `code_fd`."""
    exe, mounts = _mounts()
    cmd = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net",
           "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
    if os.geteuid() == 0:
        cmd += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    return cmd + mounts + ["--perms", "0444", "--file", str(code_fd), "/tmp/main.py", "--remount-ro", "/",
                           "--chdir", "/tmp", "--clearenv", "--info-fd", str(info_fd), "--",
                           exe, "-I", "-S", "-c", _BOOTSTRAP, str(NOBODY), *limits]


def run(code: str, *, timeout_s: float, cpu_s: int, memory_bytes: int, file_bytes: int,
        read_bytes: int) -> tuple[int | None, str, str]:
    """Run `code` in the sandbox: (exit status, or None when the wall clock ran out; the first
    `read_bytes` of stdout; the last 1 KiB of stderr). Every process of the call has ended when
    this returns."""
    limits = [str(cpu_s), str(memory_bytes), str(file_bytes)]
    with tempfile.TemporaryDirectory(prefix="megarl-python-tool-") as work:
        src_path, out_path, err_path = (os.path.join(work, n) for n in ("main.py", "stdout", "stderr"))
        with open(src_path, "w") as f:
            f.write(code)
        info_r, info_w = os.pipe()
        try:
            with open(src_path, "rb") as src, open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(_command(src.fileno(), info_w, limits), stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, env={}, pass_fds=(src.fileno(), info_w), start_new_session=True)
                os.close(info_w)
                info_w = -1
                try:
                    status = proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    status = None
                finally:
                    _stop(proc, info_r)
        finally:
            for fd in (info_r, info_w):
                if fd >= 0:
                    os.close(fd)
        with open(out_path, "rb") as f:
            stdout = f.read(read_bytes).decode("utf-8", errors="replace")
        with open(err_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 1024))
            stderr = f.read().decode("utf-8", errors="replace")
    return status, stdout, stderr


def _stop(proc: subprocess.Popen, info_r: int) -> None:
    """End the call: kill a sandbox still running through its PID namespace's first process
    (bwrap's --info-fd names it), whose end the kernel holds back until every other process of
    the namespace has ended, and wait for that end. bwrap reports the program's exit status as
    soon as the program exits, before the namespace is gone, so the wait is needed either way."""
    os.set_blocking(info_r, False)
    try:
        found = re.search(rb'"child-pid"\s*:\s*(\d+)', os.read(info_r, 4096))
        pidfd = os.pidfd_open(int(found[1])) if found else None
    except OSError:  # no sandbox started, it has ended, or no pidfd (Linux < 5.3): bwrap's kill below
        pidfd = None
    if pidfd is not None:
        try:
            if proc.poll() is None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            ended = select.poll()
            ended.register(pidfd, select.POLLIN)
            ended.poll(30_000)  # readable once it has ended
        finally:
            os.close(pidfd)
    try:
        proc.wait(timeout=10 if pidfd is not None else 0)
    except subprocess.TimeoutExpired:  # bwrap itself hangs, or there was no pidfd to kill through
        os.killpg(proc.pid, signal.SIGKILL)  # --die-with-parent then ends the namespace
        proc.wait()


def _version(bwrap: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"(\d+)\.(\d+)", out)
    return tuple(int(x) for x in found.groups()) if found else None


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Why the sandbox cannot run here, in one line; None when it can (one sandboxed call that
    must report uid and gid 65534). Cached: it is asked before any role loads and again by each
    python tool."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return ("the python tool's sandbox needs bubblewrap, and bwrap is not on PATH: install it "
                "(apt-get install bubblewrap; launchers/local/setup.sh does)")
    version = _version(bwrap)
    if version is None or version < MIN_VERSION:
        return (f"the python tool's sandbox needs bubblewrap >= {'.'.join(map(str, MIN_VERSION))}, "
                f"{bwrap} is {'.'.join(map(str, version)) if version else 'of unknown version'}")
    status, out, err = run("import os\nprint(os.getuid(), os.getgid())", timeout_s=30, cpu_s=10,
                           memory_bytes=256 << 20, file_bytes=1 << 16, read_bytes=256)
    if status == 0 and out.split() == [str(NOBODY)] * 2:
        return None
    last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()),
                "no answer in 30 s" if status is None else f"exit status {status}, output {out.strip()!r}")
    need = ("as root it needs CAP_SYS_ADMIN (a privileged container), or run megarl as another user"
            if os.geteuid() == 0 else "it needs unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone"
            "=1, user.max_user_namespaces > 0, and where AppArmor restricts them, a profile that lets bwrap)")
    return f"the python tool's sandbox does not start here: {last}; {need}"
