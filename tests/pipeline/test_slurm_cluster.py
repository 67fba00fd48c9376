"""The local two-node SLURM cluster fixture, exercised with real jobs.

Skips (with the reason) where no cluster can be started: not root, no apt, a failed install,
or SLURM_TEST_FORCE_SKIP=1.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import slurm_cluster as sc
from tests.helpers.slurm_cluster import SlurmCluster, slurm_cluster_fixture  # noqa: F401

PY = sys.executable  # the repository's venv Python: jobs share this filesystem


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.1)


def _assert_state(cluster: SlurmCluster, job: int, want: str, out: Path | None = None) -> None:
    state = cluster.wait(job, timeout=90)
    if state != want:
        detail = out.read_text() if out is not None and out.exists() else "(no output)"
        pytest.fail(f"job {job}: {state}, want {want}\n{cluster.job_info(job)}\n{detail}")


@pytest.mark.slow  # a real 2-node SLURM cluster (installs SLURM with apt when missing)
def test_two_nodes_four_ranks(slurm_cluster: SlurmCluster, tmp_path):
    out = tmp_path / "ranks.out"
    script = f"""#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --output={out}
srun {PY} -c "import os; print('RANK', os.environ['SLURM_PROCID'], \
os.environ['SLURM_NTASKS'], os.environ['SLURMD_NODENAME'])"
"""
    job = slurm_cluster.sbatch(script)
    _assert_state(slurm_cluster, job, "COMPLETED", out)
    lines = [line.split() for line in out.read_text().splitlines() if line.startswith("RANK")]
    assert len(lines) == 4, out.read_text()
    assert sorted(int(rank) for _, rank, _, _ in lines) == [0, 1, 2, 3]
    assert {ntasks for _, _, ntasks, _ in lines} == {"4"}
    assert {node for _, _, _, node in lines} == set(slurm_cluster.nodes)
    # Block distribution: ranks 0,1 on one node, 2,3 on the other.
    by_rank = {int(rank): node for _, rank, _, node in lines}
    assert by_rank[0] == by_rank[1] != by_rank[2] == by_rank[3]
    info = slurm_cluster.job_info(job)
    assert info["NumNodes"] == "2" and info["NumTasks"] == "4", info


@pytest.mark.slow  # a real 2-node SLURM cluster (installs SLURM with apt when missing)
def test_usr1_to_batch_shell(slurm_cluster: SlurmCluster, tmp_path):
    """scancel --signal=USR1 --batch: the batch script's trap runs (as with --signal=B:USR1@T)."""
    ready, marker, out = tmp_path / "ready", tmp_path / "marker", tmp_path / "job.out"
    script = f"""#!/bin/bash
#SBATCH --output={out}
trap 'echo "USR1 at $(date +%s.%N)" > {marker}; kill $sleeper 2>/dev/null' USR1
sleep 60 &
sleeper=$!
touch {ready}
wait
echo after-wait
"""
    job = slurm_cluster.sbatch(script, "--signal=B:USR1@30", "--time=5")
    _wait_for(ready)
    t0 = time.time()
    slurm_cluster.scancel(job, "USR1")
    _wait_for(marker, timeout=20)
    assert float(marker.read_text().split()[-1]) - t0 < 10
    _assert_state(slurm_cluster, job, "COMPLETED", out)
    assert "after-wait" in out.read_text()


@pytest.mark.slow  # a real 2-node SLURM cluster (installs SLURM with apt when missing)
def test_usr1_to_steps(slurm_cluster: SlurmCluster, tmp_path):
    """scancel --signal=USR1 (no --batch): the srun tasks get it, the batch shell does not."""
    out = tmp_path / "job.out"
    step = (
        "import os, pathlib, signal, sys, time\n"
        "d = pathlib.Path(sys.argv[1]); r = os.environ['SLURM_PROCID']\n"
        "signal.signal(signal.SIGUSR1, lambda *a: (d / f'got{r}').touch() or sys.exit(0))\n"
        "(d / f'ready{r}').touch()\n"
        "time.sleep(60)\n"
        "sys.exit(3)\n"
    )
    (tmp_path / "step.py").write_text(step)
    script = f"""#!/bin/bash
#SBATCH --output={out}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
trap 'touch {tmp_path}/batch-got-usr1' USR1
srun {PY} {tmp_path}/step.py {tmp_path} &
wait
"""
    job = slurm_cluster.sbatch(script)
    _wait_for(tmp_path / "ready0")
    _wait_for(tmp_path / "ready1")
    slurm_cluster.scancel(job, "USR1", batch=False)
    _assert_state(slurm_cluster, job, "COMPLETED", out)
    assert (tmp_path / "got0").exists() and (tmp_path / "got1").exists(), out.read_text()
    assert not (tmp_path / "batch-got-usr1").exists()


@pytest.mark.slow  # a real 2-node SLURM cluster (installs SLURM with apt when missing)
def test_requeue_round_trip(slurm_cluster: SlurmCluster, tmp_path):
    """First run traps USR1 and requeues itself; the second run (restart count 1) finishes."""
    out = tmp_path / "job.out"
    script = f"""#!/bin/bash
#SBATCH --output={out}
#SBATCH --open-mode=append
#SBATCH --requeue
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
n=${{SLURM_RESTART_COUNT:-0}}
log={tmp_path}/run$n.log
echo "start restart=$n job=$SLURM_JOB_ID" >> $log
if [ "$n" = 0 ]; then
  trap 'echo "usr1 -> requeue" >> $log; scontrol requeue $SLURM_JOB_ID; exit 0' USR1
  srun sleep 60 &
  touch {tmp_path}/ready
  wait
  echo "not requeued" >> $log
  exit 1
fi
srun hostname >> $log
echo "done restart=$n" >> $log
"""
    job = slurm_cluster.sbatch(script)
    _wait_for(tmp_path / "ready")
    time.sleep(0.5)  # srun's step is up: the requeue then also ends a real step
    slurm_cluster.scancel(job, "USR1")
    slurm_cluster.wait(job, timeout=60, states=("PENDING",))
    info = slurm_cluster.job_info(job)
    assert info["Restarts"] == "1" and info["Reason"] == "BeginTime", info  # the 120 s hold
    t0 = time.monotonic()
    slurm_cluster.release_requeued(job)
    _assert_state(slurm_cluster, job, "COMPLETED", out)
    assert time.monotonic() - t0 < 60, "release_requeued did not cut the 120 s BeginTime"
    run0 = (tmp_path / "run0.log").read_text()
    run1 = (tmp_path / "run1.log").read_text()
    assert f"start restart=0 job={job}" in run0 and "usr1 -> requeue" in run0, run0
    assert "not requeued" not in run0, run0
    assert f"start restart=1 job={job}" in run1 and "done restart=1" in run1, run1
    assert len([line for line in run1.splitlines() if not line.startswith(("start", "done"))]) == 2


@pytest.mark.slow  # a real 2-node SLURM cluster (installs SLURM with apt when missing)
def test_dependency_afterok(slurm_cluster: SlurmCluster, tmp_path):
    a_script = f"""#!/bin/bash
#SBATCH --output={tmp_path}/a.out
sleep 3
date +%s.%N > {tmp_path}/a_end
"""
    b_script = f"""#!/bin/bash
#SBATCH --output={tmp_path}/b.out
date +%s.%N > {tmp_path}/b_start
"""
    a = slurm_cluster.sbatch(a_script)
    b = slurm_cluster.sbatch(b_script, f"--dependency=afterok:{a}")
    info = slurm_cluster.job_info(b)
    assert info["JobState"] == "PENDING" and info["Reason"] == "Dependency", info
    _assert_state(slurm_cluster, a, "COMPLETED")
    _assert_state(slurm_cluster, b, "COMPLETED", tmp_path / "b.out")
    a_end = float((tmp_path / "a_end").read_text())
    b_start = float((tmp_path / "b_start").read_text())
    assert b_start >= a_end

    # afterok on a failed job: never runs (stays pending, DependencyNeverSatisfied).
    failing = slurm_cluster.sbatch("#!/bin/bash\nexit 2\n")
    never = slurm_cluster.sbatch(b_script, f"--dependency=afterok:{failing}")
    _assert_state(slurm_cluster, failing, "FAILED")
    deadline = time.monotonic() + 30
    while slurm_cluster.job_info(never)["Reason"] != "DependencyNeverSatisfied":
        assert time.monotonic() < deadline, slurm_cluster.job_info(never)
        time.sleep(0.2)
    assert slurm_cluster.state(never) == "PENDING"
    slurm_cluster.scancel(never)
    assert slurm_cluster.wait(never, timeout=30) == "CANCELLED"


# --- without a cluster: the skip path and the parsing


def test_force_skip_reason(monkeypatch):
    monkeypatch.setenv("SLURM_TEST_FORCE_SKIP", "1")
    assert sc.slurm_skip_reason() == "SLURM_TEST_FORCE_SKIP is set"


def test_not_root_skip_reason(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = sc._compute_skip_reason()
    assert reason is not None and "root" in reason


def test_parse_scontrol_record():
    line = (
        "JobId=7 JobName=my job UserId=root(0) JobState=PENDING Reason=BeginTime "
        "Dependency=(null) TRES=cpu=4,node=2,billing=4 ReqB:S:C:T=0:0:*:* CPUs/Task=1 "
        "Comment=two words WorkDir=/tmp/x"
    )
    info = sc.parse_scontrol_record(line)
    assert info["JobId"] == "7" and info["JobName"] == "my job"
    assert info["TRES"] == "cpu=4,node=2,billing=4" and info["ReqB:S:C:T"] == "0:0:*:*"
    assert info["CPUs/Task"] == "1" and info["Comment"] == "two words"
    assert info["WorkDir"] == "/tmp/x" and info["JobState"] == "PENDING"
