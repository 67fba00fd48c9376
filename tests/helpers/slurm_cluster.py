"""A real two-node SLURM cluster on this one machine, for tests that submit real jobs.

Slurm 22.05 from Debian (``slurmctld``, ``slurmd``, ``slurm-client``, ``munge``): one
``slurmctld`` and two ``slurmd`` (``-N node1``, ``-N node2``) that both listen on loopback,
started by hand (no systemd). Use the session fixture::

    from tests.helpers.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401

    def test_job(slurm_cluster: SlurmCluster, tmp_path):
        job = slurm_cluster.sbatch(script, "--nodes=2", f"--output={tmp_path}/%j.out")
        assert slurm_cluster.wait(job) == "COMPLETED"

Subprocesses that call SLURM clients themselves must get ``env=slurm_cluster.env`` (it holds
``SLURM_CONF``); jobs inherit it (``sbatch`` exports the environment), so ``srun``/``scontrol``
inside a job script reach this cluster. Jobs run as root on the same filesystem: a job script
can ``cd`` into the repository and run its venv's Python by absolute path.

Choices and where things live:

* Requirements: Linux, root, and either the binaries already installed or ``apt-get``. When
  missing, :func:`slurm_skip_reason` runs ``apt-get update`` and ``apt-get install -y
  --no-install-recommends slurmctld slurmd slurm-client munge`` once (log:
  ``/tmp/onebit-slurm-install.log``; its tail goes into the skip reason when it fails). It
  never re-runs apt when the binaries exist. ``SLURM_TEST_FORCE_SKIP=1`` forces a skip.
* Ports: the first free triple of ``base`` (slurmctld), ``base+1`` (node1's slurmd), ``base+2``
  (node2's slurmd) among ``PORT_BASES`` = 27817, 28817, 29817, 30817, 31817: below Linux's
  ephemeral range (32768+) and away from Slurm's defaults (6817/6818), so neither a system
  Slurm nor outgoing connections take them.
* ClusterName ``onebit<pid>`` (pid of the test process): unique per session.
* Everything of the cluster lives under ``workdir``: ``onebit-test-slurm.conf``, ``state/``
  (StateSaveLocation), ``spool/node1``, ``spool/node2`` (SlurmdSpoolDir), ``run/*.pid``,
  ``log/slurmctld.log``, ``log/slurmd-node1.log``, ``log/slurmd-node2.log``, ``jobs/`` (the
  default working directory of :meth:`SlurmCluster.sbatch`). Only when ``workdir`` is too long
  for the unix sockets slurmstepd makes in the spool (108 bytes) does the spool go to a short
  ``/tmp/slurm-spool-*`` directory instead.
* Shared machine state it touches: munge (``/etc/munge/munge.key`` created when missing, owner
  munge, mode 0400 -- Debian's package already makes one; ``/run/munge``; ``munged`` as user
  munge) and ``/etc/hosts`` (``127.0.0.1 node1 node2`` appended only when the names do not
  resolve; the line is left there). A munged that was running before is reused and left
  running; one this module starts is recorded in ``/run/munge/onebit-test-owner`` and stopped
  at shutdown (unless a concurrent session's cluster still uses it); a munged recorded there
  whose session has died is adopted and stopped at the end of this session.
* Daemons left by an earlier session: :func:`start_cluster` STOPS them. They are recognised by
  their command line (``-f .../onebit-test-slurm.conf``) and an ``owner`` file next to that
  conf naming the test process that started them ("pid starttime"): when that process is
  gone (or the file is), their slurmctld/slurmd are killed, and so is every process that runs
  with ``SLURM_CONF=<that conf>`` (slurmstepd's, job scripts, sruns, tasks). Daemons of a
  session that is still alive (a concurrent test run) and any other Slurm on the machine are
  left alone; they do not clash since each session has its own ports and directories.
* :meth:`SlurmCluster.shutdown` cancels the remaining jobs (waits up to 15 s for the queue to
  empty), stops the slurmd's and the slurmctld by their pid files (SIGTERM, SIGKILL after
  10 s), kills leftover processes with this cluster's SLURM_CONF, and stops munged as above.
  It also runs at interpreter exit (atexit) when the fixture's teardown did not.
* Scheduling: ``SchedulerParameters=batch_sched_delay=0,sched_interval=1`` so that jobs start
  ~1 s after submission (not ~3 s) and a requeued job released with
  :meth:`SlurmCluster.release_requeued` starts ~2-3 s later (not at the next 30 s backfill
  pass). The first job after start waits ~2-3 s (the controller's first scheduling pass).
  ``KillWait=5``, ``MinJobAge=600`` (finished jobs stay in ``scontrol show job`` for 10 min).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import shutil
import signal as _signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

NODES = ("node1", "node2")
PORT_BASES = (27817, 28817, 29817, 30817, 31817)
CONF_NAME = "onebit-test-slurm.conf"
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
INSTALL_LOG = Path(tempfile.gettempdir()) / "onebit-slurm-install.log"
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN = Path("/run/munge")
MUNGE_SOCKET = MUNGE_RUN / "munge.socket.2"
MUNGE_PIDFILE = MUNGE_RUN / "munged.pid"
MUNGE_OWNER = MUNGE_RUN / "onebit-test-owner"  # "<munged pid> <test pid> <its start time>"
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MAX_SPOOL_PREFIX = 60  # spool dir + "/node1/node1_<job>.<step>" must stay < 108 bytes


class SlurmClusterError(RuntimeError):
    """The cluster could not be started, or a client command failed."""


# ----------------------------------------------------------------------------- helpers


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + _SBIN_PATH)


def _missing_binaries() -> list[str]:
    return [b for b in (*BINARIES, "munged", "munge", "unmunge") if _which(b) is None]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no {path})"
    return "\n".join(text.splitlines()[-lines:])


def _proc_starttime(pid: int) -> str | None:
    """Start time of a process (clock ticks since boot): tells a pid from a reused one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _processes(names: Iterable[str]) -> list[tuple[int, list[str]]]:
    """(pid, argv) of the live processes whose comm is one of ``names``."""
    wanted = set(names)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            if comm not in wanted:
                continue
            argv = [
                a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")
            ]
        except OSError:
            continue
        if _alive(int(entry.name)):
            found.append((int(entry.name), [a for a in argv if a]))
    return found


def _terminate(pids: Iterable[int], grace: float = 10.0) -> None:
    """SIGTERM the processes, wait up to ``grace`` seconds, SIGKILL what is left."""
    pids = [p for p in pids if _alive(p)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, _signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, _signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _clean_env(conf: Path | None = None) -> dict[str, str]:
    """os.environ without an outer Slurm job's variables (pytest may itself run in a job)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_"))
    }
    if conf is not None:
        env["SLURM_CONF"] = str(conf)
    path = env.get("PATH", "")
    missing = [p for p in _SBIN_PATH.split(":") if p not in path.split(":")]
    env["PATH"] = ":".join([p for p in [path, *missing] if p])
    return env


def parse_scontrol_record(line: str) -> dict[str, str]:
    """``Key=Value Key2=Value two ...`` (one ``scontrol show -o`` record) as a dict.

    A whitespace-separated token that does not start with ``Key=`` continues the previous
    value (values such as ``Reason`` or ``Comment`` can hold spaces); a value may hold ``=``
    (``TRES=cpu=4,node=2``).
    """
    info: dict[str, str] = {}
    key = None
    for token in line.split():
        match = re.match(r"^([A-Za-z][A-Za-z0-9_:/]*)=(.*)$", token)
        if match:
            key = match.group(1)
            info[key] = match.group(2)
        elif key is not None:
            info[key] += " " + token
    return info


# ------------------------------------------------------------------------ installation

_skip_reason_cache: list[str | None] = []


def slurm_skip_reason() -> str | None:
    """None when a cluster can be started here (installing Slurm first if needed), else why not.

    The answer (and any installation) happens once per process; ``SLURM_TEST_FORCE_SKIP=1``
    in the environment always answers with a skip reason, without touching anything.
    """
    if os.environ.get("SLURM_TEST_FORCE_SKIP", "") not in ("", "0"):
        return "SLURM_TEST_FORCE_SKIP is set"
    if not _skip_reason_cache:
        _skip_reason_cache.append(_compute_skip_reason())
    return _skip_reason_cache[0]


def _compute_skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"a local SLURM cluster needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (to install Slurm and start slurmd/munged)"
    if not _missing_binaries():
        return None
    if _which("apt-get") is None:
        return f"Slurm is not installed ({', '.join(_missing_binaries())} missing) and no apt-get"
    # One installer at a time across concurrent sessions (apt's own lock would fail instead).
    with open(Path(tempfile.gettempdir()) / "onebit-slurm-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _missing_binaries():
            return None
        return _apt_install()


_install_seconds: list[float] = []  # how long this process's apt-get run took


def _apt_install() -> str | None:
    t0 = time.monotonic()
    try:
        return _apt_commands()
    finally:
        _install_seconds.append(time.monotonic() - t0)


def _apt_commands() -> str | None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    env["PATH"] = _clean_env()["PATH"]
    commands = [
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],
    ]
    with open(INSTALL_LOG, "w") as log:
        for cmd in commands:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            try:
                rc = subprocess.run(
                    cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, timeout=600, check=False,
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                log.flush()
                return (
                    f"installing Slurm failed ({' '.join(cmd[:2])}: exit {rc}); "
                    f"log {INSTALL_LOG}, tail:\n{_tail(INSTALL_LOG)}"
                )
    missing = _missing_binaries()
    if missing:
        return (
            f"apt-get install finished but {', '.join(missing)} still missing (log {INSTALL_LOG})"
        )
    return None


# ------------------------------------------------------------------------------ cluster


class SlurmCluster:
    """A running two-node cluster; client helpers run with ``env`` (which holds SLURM_CONF)."""

    def __init__(self, workdir: Path, conf: Path, cluster_name: str, ports: dict[str, int]):
        self.workdir = workdir
        self.conf = conf
        self.cluster_name = cluster_name
        self.ports = ports  # {"slurmctld": p, "node1": p+1, "node2": p+2}
        self.nodes = list(NODES)
        self.env = _clean_env(conf)
        self.log_dir = workdir / "log"
        self.run_dir = workdir / "run"
        self.jobs_dir = workdir / "jobs"
        self.timings: dict[str, float] = {}  # seconds: "install" (apt-get), "start" (daemons)
        self._started_munged: int | None = None
        self._extra_dirs: list[Path] = []
        self._down = False

    # -- clients

    def _run(self, *cmd: str, check: bool = True, timeout: float = 60, **kw):
        proc = subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and proc.returncode != 0:
            raise SlurmClusterError(
                f"{' '.join(cmd)} failed (exit {proc.returncode}): "
                f"{proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def sbatch(self, script: Path | str, *args: str, cwd: Path | str | None = None) -> int:
        """Submit a batch script; returns the job id.

        ``script`` is a path to a script file, or (a ``str`` starting with ``#!``) the text of
        a script, given to sbatch on stdin. ``args`` are sbatch options (before the script).
        The job's working directory is ``cwd`` (default: ``<workdir>/jobs``, so stray
        ``slurm-N.out`` files never land in the repository).
        """
        cwd = Path(cwd) if cwd is not None else self.jobs_dir
        if isinstance(script, str) and script.startswith("#!"):
            proc = self._run("sbatch", *args, input=script, cwd=cwd)
        else:
            proc = self._run("sbatch", *args, str(Path(script).resolve()), cwd=cwd)
        match = re.search(r"Submitted batch job (\d+)", proc.stdout)
        if not match:
            raise SlurmClusterError(f"unexpected sbatch output: {proc.stdout!r} {proc.stderr!r}")
        return int(match.group(1))

    def job_info(self, job_id: int) -> dict[str, str]:
        """All ``Key=Value`` pairs of ``scontrol show job -o <id>`` (values may hold spaces)."""
        out = self._run("scontrol", "show", "job", "-o", str(job_id)).stdout.strip()
        info = parse_scontrol_record(out.splitlines()[0] if out else "")
        if info.get("JobId") != str(job_id):
            raise SlurmClusterError(f"no job {job_id} in `scontrol show job`: {out!r}")
        return info

    def state(self, job_id: int) -> str:
        """JobState, e.g. PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED."""
        return self.job_info(job_id)["JobState"]

    def wait(
        self,
        job_id: int,
        timeout: float = 300,
        states: Iterable[str] = FINAL_STATES,
        poll: float = 0.25,
    ) -> str:
        """Poll until the job's state is one of ``states``; returns it (TimeoutError if not)."""
        states = tuple(states)
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job_id)
            if state in states:
                return state
            if time.monotonic() > deadline:
                info = self.job_info(job_id)
                raise TimeoutError(
                    f"job {job_id} still {state} (Reason={info.get('Reason')}) after "
                    f"{timeout} s, waiting for {states}"
                )
            time.sleep(poll)

    def scancel(self, job_id: int, signal: str | None = None, *, batch: bool = True) -> None:
        """Cancel a job, or with ``signal`` (e.g. ``"USR1"``) just send it that signal.

        With a signal and ``batch=True`` (the default) it runs ``scancel --signal=SIG --batch``:
        the signal goes to the batch shell only (what ``--signal=B:SIG@T`` does at the time
        limit), which is where a ``trap`` in the job script sees it; the shell must be waiting
        in ``wait`` (run ``srun ... &`` / ``sleep ... &`` first) for the trap to run promptly.
        ``batch=False`` runs ``scancel --signal=SIG`` without ``--batch``: the signal goes to
        every job step (the srun-launched tasks, as ``--signal=SIG@T`` does) but NOT to the
        batch shell. Without ``signal`` the job is cancelled.
        """
        cmd = ["scancel"]
        if signal is not None:
            cmd.append(f"--signal={signal}")
            if batch:
                cmd.append("--batch")
        self._run(*cmd, str(job_id))

    def release_requeued(self, job_id: int, timeout: float = 60) -> None:
        """Let a requeued job start in ~2 s instead of 120 s (its BeginTime after a requeue).

        Waits (up to ``timeout``) for the job to be back in PENDING (it is RUNNING/COMPLETING
        until the first run's processes have ended), then ``scontrol update JobId=N
        StartTime=now+2``. Not ``StartTime=now``: a relaunch within the same second as the
        requeue's kill is refused by slurmd ("Job credential revoked", credential times have
        1 s resolution) and the job then ends FAILED instead of running again.
        """
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            if info["JobState"] == "PENDING":
                proc = self._run(
                    "scontrol", "update", f"JobId={job_id}", "StartTime=now+2", check=False
                )
                if proc.returncode == 0:
                    return
                error = proc.stderr.strip()
            else:
                error = f"state {info['JobState']}"
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"could not release requeued job {job_id}: {error}")
            time.sleep(0.2)

    def squeue(self) -> list[int]:
        """Ids of the jobs the controller still has pending/running/completing."""
        out = self._run("squeue", "-h", "-o", "%i").stdout
        return [int(line.split("_")[0]) for line in out.split() if line.strip()]

    def node_states(self) -> dict[str, str]:
        """{node: compact state} from sinfo (idle, alloc, mix, down, ...)."""
        proc = self._run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=15)
        states = {}
        for line in proc.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                states[parts[0]] = parts[1]
        return states

    def logs(self, lines: int = 20) -> str:
        """The tails of the daemons' logs (for error messages)."""
        return "\n".join(
            f"--- {p.name}\n{_tail(p, lines)}" for p in sorted(self.log_dir.glob("*.log"))
        )

    # -- lifecycle

    def _pidfiles(self) -> list[Path]:
        return [self.run_dir / f"slurmd-{n}.pid" for n in self.nodes] + [
            self.run_dir / "slurmctld.pid"
        ]

    def shutdown(self) -> None:
        """Cancel remaining jobs, stop the slurmd's and the slurmctld (pid files), and munged
        when this cluster started it. Idempotent."""
        if self._down:
            return
        self._down = True
        try:
            jobs = self.squeue()
            if jobs:
                self._run("scancel", *map(str, jobs), check=False)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and self.squeue():
                    time.sleep(0.2)
        except (SlurmClusterError, subprocess.TimeoutExpired, OSError):
            pass
        ours = {pid for pid, argv in _processes(("slurmctld", "slurmd")) if str(self.conf) in argv}
        # The pid files name them; the command line check guards against a reused pid (and
        # catches a daemon whose pid file is missing).
        daemon_pids = [p for p in map(_read_pid, self._pidfiles()) if p in ours]
        daemon_pids += sorted(ours - set(daemon_pids))
        _terminate(daemon_pids)
        _terminate(_job_processes([self.conf]), grace=2)
        if self._started_munged is not None:
            _stop_munged_if_unused(self._started_munged)
            self._started_munged = None
        for d in self._extra_dirs:
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.workdir / "owner").unlink()


def _job_processes(confs: Iterable[Path]) -> list[int]:
    """Processes that run with SLURM_CONF=<one of confs>: jobs' scripts, sruns and tasks (they
    inherit it from sbatch's environment) and the slurmstepd's (from their slurmd)."""
    wanted = {f"SLURM_CONF={c}".encode() for c in confs}
    me = os.getpid()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if environ & wanted and _alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def _owner_alive_text(owner: str) -> bool:
    """Whether the test process named by ``owner`` ("pid starttime") still runs."""
    try:
        pid, start = owner.split()[:2]
        return _proc_starttime(int(pid)) == start
    except ValueError:
        return False


def _owner_alive(owner_file: Path) -> bool:
    try:
        return _owner_alive_text(owner_file.read_text())
    except OSError:
        return False


def _fixture_daemons() -> list[tuple[int, Path, bool]]:
    """(pid, conf, owner alive) of the slurmctld/slurmd started by this module, any session."""
    found = []
    for pid, argv in _processes(("slurmctld", "slurmd")):
        conf = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-f"), None)
        if conf is not None and Path(conf).name == CONF_NAME:
            found.append((pid, Path(conf), _owner_alive(Path(conf).parent / "owner")))
    return found


def _stop_stale_daemons() -> list[int]:
    """Stop the slurmctld/slurmd (and their jobs) that an earlier, now dead, test session left
    running. Other Slurm daemons, and those of live sessions, are left alone."""
    stale = [(pid, conf) for pid, conf, alive in _fixture_daemons() if not alive]
    if stale:
        confs = {conf for _, conf in stale}
        _terminate([pid for pid, _ in stale], grace=5)
        _terminate(_job_processes(confs), grace=2)
    return [pid for pid, _ in stale]


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _choose_ports() -> dict[str, int]:
    for base in PORT_BASES:
        ports = [base + i for i in range(1 + len(NODES))]
        if all(_port_free(p) for p in ports):
            return dict(zip(("slurmctld", *NODES), ports, strict=True))
    raise SlurmClusterError(f"no free port triple at any of the bases {PORT_BASES}")


def _ensure_hosts() -> None:
    missing = []
    for name in NODES:
        try:
            socket.gethostbyname(name)
        except OSError:
            missing.append(name)
    if missing:
        with open("/etc/hosts", "a") as hosts:
            hosts.write(f"127.0.0.1 {' '.join(missing)}\n")


def _munge_works(env: dict[str, str]) -> bool:
    if not MUNGE_SOCKET.exists():
        return False
    try:
        cred = subprocess.run(
            ["munge", "-n"], env=env, capture_output=True, timeout=10, check=True
        ).stdout
        subprocess.run(
            ["unmunge"], input=cred, env=env, capture_output=True, timeout=10, check=True
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return False
    return True


def _ensure_munge(env: dict[str, str]) -> int | None:
    """Make munged run; returns its pid when this call started it (None: it was running)."""
    import grp
    import pwd

    running = [pid for pid, _ in _processes(("munged",))]
    if running and _munge_works(env):
        # Started by a test session that has ended (crashed)? Adopt it: stop it at shutdown.
        try:
            munged_pid, owner = MUNGE_OWNER.read_text().split(maxsplit=1)
            if int(munged_pid) in running and not _owner_alive_text(owner):
                _write_munge_owner(int(munged_pid))
                return int(munged_pid)
        except (OSError, ValueError):
            pass
        return None
    uid = pwd.getpwnam("munge").pw_uid
    gid = grp.getgrnam("munge").gr_gid
    MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
    if not MUNGE_KEY.exists():
        fd = os.open(MUNGE_KEY, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as key:
            key.write(os.urandom(1024))
    os.chown(MUNGE_KEY.parent, uid, gid)
    os.chmod(MUNGE_KEY.parent, 0o700)
    os.chown(MUNGE_KEY, uid, gid)
    os.chmod(MUNGE_KEY, 0o400)
    for d in (MUNGE_RUN, Path("/var/lib/munge"), Path("/var/log/munge")):
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, uid, gid)
    os.chmod(MUNGE_RUN, 0o755)
    # A munged that runs but does not answer (stale socket/pid file): replace it.
    _terminate([pid for pid, _ in _processes(("munged",))])
    for stale in (MUNGE_SOCKET, MUNGE_PIDFILE):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    munged = _which("munged") or "/usr/sbin/munged"
    with tempfile.TemporaryFile() as err:
        rc = subprocess.run(
            ["runuser", "-u", "munge", "--", munged], env=_clean_env(), stdin=subprocess.DEVNULL,
            stdout=err, stderr=err, timeout=30, check=False,
        ).returncode  # fmt: skip
        if rc != 0:
            err.seek(0)
            raise SlurmClusterError(f"munged failed to start: {err.read().decode().strip()}")
    deadline = time.monotonic() + 15
    while not _munge_works(env):
        if time.monotonic() > deadline:
            raise SlurmClusterError(
                f"munged does not answer: {_tail(Path('/var/log/munge/munged.log'))}"
            )
        time.sleep(0.1)
    pid = _read_pid(MUNGE_PIDFILE)
    if pid is not None:
        _write_munge_owner(pid)
    return pid


def _write_munge_owner(munged_pid: int) -> None:
    MUNGE_OWNER.write_text(f"{munged_pid} {os.getpid()} {_proc_starttime(os.getpid())}\n")


def _stop_munged_if_unused(munged_pid: int) -> None:
    """Stop the munged this session started (or adopted), unless a concurrent session's
    cluster still needs it; then the owner file stays and a later session adopts it."""
    if any(alive for _, _, alive in _fixture_daemons()):
        return
    _terminate([munged_pid])
    with contextlib.suppress(OSError):
        MUNGE_OWNER.unlink()


def _write_conf(
    conf: Path, workdir: Path, spool: Path, name: str, ports: dict[str, int], cpus: int
) -> None:
    node_lines = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports[n]} "
        f"CPUs={cpus} RealMemory=4000 State=UNKNOWN"
        for n in NODES
    )
    conf.write_text(
        f"""\
# Written by tests/helpers/slurm_cluster.py for one test session; do not edit.
ClusterName={name}
SlurmctldHost=localhost
SlurmctldPort={ports["slurmctld"]}
SlurmdPort={ports[NODES[0]]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={workdir}/state
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={workdir}/run/slurmctld.pid
SlurmdPidFile={workdir}/run/slurmd-%n.pid
SlurmctldLogFile={workdir}/log/slurmctld.log
SlurmdLogFile={workdir}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_interval=1
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobRequeue=1
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
{node_lines}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
    )


def _start_daemon(cluster: SlurmCluster, name: str, *args: str) -> None:
    """Run a self-daemonizing Slurm daemon; its early stderr goes to log/<name>.stderr."""
    suffix = f"-{args[-1]}" if "-N" in args else ""
    stderr_path = cluster.log_dir / f"{name}{suffix}.stderr"
    with open(stderr_path, "ab") as err:
        rc = subprocess.run(
            [_which(name) or name, *args], env=cluster.env, stdin=subprocess.DEVNULL,
            stdout=err, stderr=err, timeout=60, check=False,
        ).returncode  # fmt: skip
    if rc != 0:
        raise SlurmClusterError(
            f"{name} {' '.join(args)} exited {rc}: {_tail(stderr_path)}\n{cluster.logs()}"
        )


def start_cluster(workdir: Path, cpus_per_node: int = 4) -> SlurmCluster:
    """Install Slurm if needed, start munge, slurmctld and two slurmd; wait for idle nodes.

    Raises :class:`SlurmClusterError` when Slurm cannot be used here (the reason from
    :func:`slurm_skip_reason`) or a daemon does not come up (with the logs' tails).
    """
    reason = slurm_skip_reason()
    if reason is not None:
        raise SlurmClusterError(reason)
    t_installed = time.monotonic()
    _stop_stale_daemons()

    workdir = Path(workdir).resolve()
    for sub in ("state", "log", "run", "jobs"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    (workdir / "owner").write_text(f"{os.getpid()} {_proc_starttime(os.getpid())}\n")
    extra_dirs = []
    spool = workdir / "spool"
    if len(str(spool)) > _MAX_SPOOL_PREFIX:
        spool = Path(tempfile.mkdtemp(prefix="slurm-spool-", dir="/tmp"))
        extra_dirs.append(spool)
    for node in NODES:
        (spool / node).mkdir(parents=True, exist_ok=True)

    ports = _choose_ports()
    name = f"onebit{os.getpid()}"
    conf = workdir / CONF_NAME
    _write_conf(conf, workdir, spool, name, ports, cpus_per_node)
    cluster = SlurmCluster(workdir, conf, name, ports)
    cluster._extra_dirs = extra_dirs
    atexit.register(cluster.shutdown)
    try:
        _ensure_hosts()
        cluster._started_munged = _ensure_munge(cluster.env)
        _start_daemon(cluster, "slurmctld", "-f", str(conf))
        for node in NODES:
            _start_daemon(cluster, "slurmd", "-f", str(conf), "-N", node)
        deadline = time.monotonic() + 45
        while True:
            states = cluster.node_states()
            if all(states.get(n) == "idle" for n in NODES):
                break
            if time.monotonic() > deadline:
                raise SlurmClusterError(
                    f"nodes not idle after 45 s (sinfo: {states})\n{cluster.logs()}"
                )
            time.sleep(0.2)
    except BaseException:
        cluster.shutdown()
        raise
    cluster.timings = {
        "install": sum(_install_seconds),  # 0 when Slurm was already there
        "start": time.monotonic() - t_installed,
    }
    return cluster


@pytest.fixture(scope="session", name="slurm_cluster")
def slurm_cluster_fixture(tmp_path_factory) -> Iterator[SlurmCluster]:
    """The ``slurm_cluster`` fixture: a running two-node cluster for the whole session.

    Import it into a test module as
    ``from tests.helpers.slurm_cluster import slurm_cluster_fixture`` (``# noqa: F401``);
    tests then take a ``slurm_cluster`` argument (no F811 redefinition).

    Skips (with the reason) when not root, not Linux, SLURM_TEST_FORCE_SKIP is set, or Slurm
    is missing and cannot be installed. A failure to start once installed is an error.
    """
    reason = slurm_skip_reason()
    if reason is not None:
        pytest.skip(f"no local SLURM cluster: {reason}")
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.shutdown()


slurm_cluster = slurm_cluster_fixture  # the same fixture, importable under its own name too
