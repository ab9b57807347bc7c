"""A real two-node SLURM cluster on localhost, for tests (slurm-wlm 22.05 + munge, Debian).

    with SlurmCluster() as cluster:                  # or the fixture in tests/test_slurm.py
        job = cluster.submit("launchers/slurm/megarl.sbatch", "--", "hostname",
                             sbatch_args=["-N", "2"], cwd=repo)
        info = cluster.wait(job, timeout=120)        # {"JobState": "COMPLETED", "ExitCode": "0:0", ...}

Everything lives in a private temporary directory: slurm.conf, state, spool, logs and a private
munged socket (no system service is touched or needed). Two slurmd processes (`-N n1`, `-N n2`)
on different ports play the two nodes; `scontrol show hostnames` yields n1, n2, which are mapped
to 127.0.0.1 in /etc/hosts when they do not resolve. Daemons run in the foreground as children
of this process and are always stopped by pid; any job process left behind is found by a marker
variable in its environment and killed by pid too.

`SlurmUnavailable` is raised only when the machine cannot host the cluster at all (binaries
missing, not root, no munge key): tests turn it into a skip. A cluster that is installed but
fails to start raises RuntimeError with the daemon logs: that is a real failure.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel")
MUNGE_KEY = Path("/etc/munge/munge.key")
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                   "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
_MARKER = "MEGARL_TEST_SLURM_CLUSTER"
REQUEUE_HOLD_S = 3  # seconds wait() leaves a requeued job held before it releases it


class SlurmUnavailable(RuntimeError):
    """This machine cannot run a local SLURM cluster (tests skip with this reason)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_available() -> None:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        raise SlurmUnavailable(f"slurm-wlm/munge not installed (missing {', '.join(missing)}); "
                               "run .ci/slurm-setup.sh")
    if os.geteuid() != 0:
        raise SlurmUnavailable("slurmd needs root to launch jobs; tests are not running as root")
    if not MUNGE_KEY.exists():
        raise SlurmUnavailable(f"{MUNGE_KEY} missing (the munge package creates it)")


def parse_kv(text: str) -> dict[str, str]:
    """`scontrol show job -o` output -> {"JobState": "RUNNING", ...}."""
    out = {}
    for token in text.split():
        if "=" in token:
            k, v = token.split("=", 1)
            out.setdefault(k, v)
    return out


class SlurmCluster:
    def __init__(self, nodes=("n1", "n2"), cpus_per_node: int = 2, real_memory_mb: int = 4000,
                 startup_timeout: float = 60.0, kill_wait: int = 15, keep_dir: bool = False):
        self.nodes = tuple(nodes)
        self.cpus_per_node = cpus_per_node
        self.real_memory_mb = real_memory_mb
        self.startup_timeout = startup_timeout
        self.kill_wait = kill_wait
        self.keep_dir = keep_dir
        self.dir: Path | None = None
        self.env: dict[str, str] = {}
        self._procs: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        check_available()
        # mkdtemp is 0700; munged insists that every directory above its socket is traversable.
        self.dir = Path(tempfile.mkdtemp(prefix="megarl-slurm-"))
        self.dir.chmod(0o755)
        for sub in ("state", "spool", "log", "munge"):
            (self.dir / sub).mkdir()
            (self.dir / sub).chmod(0o755)
        self.env = dict(os.environ, SLURM_CONF=str(self.dir / "slurm.conf"), **{_MARKER: str(self.dir)})
        try:
            self._ensure_hosts()
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", self.env["SLURM_CONF"]])
            self._wait_for(self._ctld_answers, 30, "slurmctld to answer")
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", self.env["SLURM_CONF"]])
            self._wait_for(self._nodes_idle, self.startup_timeout, "all nodes idle in sinfo")
        except Exception as exc:
            logs = self.daemon_logs()
            self.stop()
            raise RuntimeError(f"local SLURM cluster failed to start ({exc}); daemon logs:\n{logs}") from exc
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel jobs, stop the daemons we started, kill leftover job processes (all by pid)."""
        if self._procs.get("slurmctld") is not None and self._procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user", "root", check=False, timeout=15)
            deadline = time.monotonic() + self.kill_wait + 10
            while time.monotonic() < deadline and self._jobs_left():
                time.sleep(0.5)
        for name in [n for n in self._procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]:
            proc = self._procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._kill_marked_processes()
        if self.dir is not None and not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ jobs
    def run(self, *cmd: str, check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        res = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def submit(self, script: str | os.PathLike, *args: str, sbatch_args=(), env: dict | None = None,
               cwd: str | os.PathLike | None = None) -> str:
        """sbatch SCRIPT ARGS; returns the job id. `env` adds variables to the job's environment."""
        full_env = dict(self.env, **(env or {}))
        res = subprocess.run(["sbatch", "--parsable", *sbatch_args, str(script), *args], env=full_env,
                             capture_output=True, text=True, timeout=30, cwd=cwd)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}")
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        res = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        return parse_kv(res.stdout) if res.returncode == 0 else {}

    def wait(self, job_id: str, timeout: float = 120, release_requeued: bool = True,
             states=TERMINAL_STATES) -> dict[str, str]:
        """Poll until the job reaches one of `states`; return its record.

        SLURM holds a requeued job for ~2 minutes (BeginTime, the job credential's lifetime)
        before it may start again; with release_requeued the hold is lifted after a few seconds
        (`scontrol update StartTime=now`). Not at once: each slurmd revokes the old instance's
        credentials at a one-second resolution, and a new instance launched within that second
        is killed as "Job credential revoked" (seen under load: the job then ends FAILED 1:0
        instead of resuming)."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        held_since: dict[int, float] = {}  # restart count -> when its hold was first seen
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            restarts = int(info.get("Restarts", "0"))
            if (release_requeued and info.get("JobState") == "PENDING" and restarts > 0
                    and info.get("Reason") == "BeginTime"):
                since = held_since.setdefault(restarts, time.monotonic())
                if time.monotonic() - since >= REQUEUE_HOLD_S:
                    self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout}s: {info}\n{self.daemon_logs()}")

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.25):
        """Poll predicate() until truthy (returned) or raise TimeoutError naming `what`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}")

    def daemon_logs(self, tail: int = 40) -> str:
        if self.dir is None:
            return ""
        parts = []
        for path in sorted((self.dir / "log").glob("*")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            parts.append(f"==> {path.name} <==\n" + "\n".join(lines))
        return "\n".join(parts)

    # ------------------------------------------------------------------ internals
    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "ab")
        self._procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
        log.close()

    def _start_munge(self) -> None:
        """A private munged (root, copy of the system key) on a socket inside our directory."""
        mdir = self.dir / "munge"
        key = mdir / "munge.key"
        shutil.copyfile(MUNGE_KEY, key)
        key.chmod(0o600)
        self._spawn("munged", ["munged", "-F", f"--socket={mdir / 'munge.sock'}", f"--key-file={key}",
                               f"--pid-file={mdir / 'munged.pid'}", f"--log-file={self.dir / 'log' / 'munged.log'}",
                               f"--seed-file={mdir / 'munged.seed'}", "--num-threads=2"])
        self._wait_for(lambda: (mdir / "munge.sock").exists(), 15, "munged socket")

    def _write_conf(self) -> None:
        d, host = self.dir, socket.gethostname()
        lines = [
            "ClusterName=megarltest", f"SlurmctldHost={host}", f"SlurmctldPort={_free_port()}",
            "AuthType=auth/munge", f"AuthInfo=socket={d / 'munge' / 'munge.sock'}", "CredType=cred/munge",
            "SlurmUser=root", "SlurmdUser=root",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "ReturnToService=2", "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
            # trust the CPUs= below over the hardware, so a small VM can offer more job slots
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            f"KillWait={self.kill_wait}", "MinJobAge=600", "InactiveLimit=0", "SlurmdTimeout=120",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
                         f"CPUs={self.cpus_per_node} RealMemory={self.real_memory_mb} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
                     "State=UP OverSubscribe=YES")
        (d / "slurm.conf").write_text("\n".join(lines) + "\n")

    def _ensure_hosts(self) -> None:
        """Map the node names to 127.0.0.1 (idempotent; left in place for concurrent users)."""
        missing = []
        for node in self.nodes:
            try:
                socket.gethostbyname(node)
            except OSError:
                missing.append(node)
        if missing:
            try:
                with open("/etc/hosts", "a", encoding="ascii") as f:
                    f.write(f"127.0.0.1 {' '.join(missing)}  # megarl tests/slurm_cluster.py\n")
            except OSError:
                pass  # the launchers use NodeAddr, not names; only interactive use needs this

    def _ctld_answers(self) -> bool:
        self._check_alive()
        return self.run("scontrol", "ping", check=False, timeout=10).returncode == 0

    def _nodes_idle(self) -> bool:
        self._check_alive()
        res = self.run("sinfo", "-N", "-h", "-o", "%N %t", check=False, timeout=10)
        states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
        for node, state in states.items():
            if state.startswith(("down", "drain")):
                self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", check=False)
        return all(states.get(n) == "idle" for n in self.nodes)

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}")

    def _wait_for(self, predicate, timeout: float, what: str) -> None:
        self.wait_for(predicate, timeout, what)

    def _jobs_left(self) -> bool:
        res = self.run("squeue", "-h", "-o", "%i", check=False, timeout=10)
        return bool(res.stdout.strip()) and res.returncode == 0

    def _kill_marked_processes(self) -> None:
        """Job processes (slurmstepd, ranks) carry our marker in their environment: kill by pid."""
        if self.dir is None:
            return
        marker = f"{_MARKER}={self.dir}".encode()
        me = os.getpid()
        for _ in range(3):
            victims = []
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit() or int(entry.name) == me:
                    continue
                try:
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        victims.append(int(entry.name))
                except OSError:
                    continue
            if not victims:
                return
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
