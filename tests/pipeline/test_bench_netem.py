"""The emulated-cluster benchmark: the whole-round averaging of local-step runs and the
argument checks, and a 2-host, 2-step smoke (root only): it builds the namespaces, runs
LAMB, 1-bit LAMB, CO2 and the compute-only runs through the real pretraining stage, reports
consistent numbers, and leaves no namespace or bridge behind."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from bench import netem, netem_cluster
from tests.helpers.paths import REPO

REASON = netem.check_privileges() if sys.platform == "linux" else "not Linux"


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def _leaked(names: set[str]) -> set[str]:
    """Of namespaces or links that appeared during a test, those no live process owns: a
    cluster's names carry its creator's pid (``obn<pid>...``), and another benchmark running
    on the machine at the same time must not fail this one."""
    leaked = set()
    for name in names:
        digits = name[3:].split("h")[0].split("br")[0] if name.startswith("obn") else ""
        if not (digits.isdigit() and netem_cluster.pid_alive(int(digits))):
            leaked.add(name)
    return leaked


def _local_step_records(rounds: int, every: int) -> list[dict]:
    """A co2-like log: inner steps of 1 s; each outer step (every ``every``-th) takes 4 s,
    of which 3 s of blocked wait from the second round on, and launches 300 bytes; the
    statistics all-reduce and logging add 0.5 s per step outside ``step_seconds``."""
    records, now = [], 100.0
    for step in range(1, rounds * every + 1):
        outer = step % every == 0
        waits = outer and step > every
        record = {
            "step": step,
            "step_seconds": 4.0 if outer else 1.0,
            "forward_backward_seconds": 0.9,
            "comm_seconds": 3.0 if waits else 0.0,
            "comm_bytes": 300 if outer else 0,
            "net_rx_bytes": 330 if outer else 10,
            "stage": "local",
        }
        if step > every:  # the trainer logs the last wait from the first one on
            record["outer_wait_seconds"] = 3.0 if waits else 0.0
            record["outer_in_flight_seconds"] = 7.0
        now += record["step_seconds"] + 0.5
        records.append({**record, "time": now})
    return records


def test_round_summary_means_over_whole_rounds_after_the_first_two():
    records = _local_step_records(rounds=4, every=3)
    summary = netem.round_summary(records, batch=8, every=3)
    # steps 7..12: two rounds of 1 + 1 + 4 seconds (a median would say 1 s)
    assert (summary["steps"], summary["rounds"], summary["outer_every"]) == (6, 2, 3)
    assert summary["samples_per_s"] == pytest.approx(8 * 6 / 12)
    assert summary["wall_samples_per_s"] == pytest.approx(8 * 6 / 15)
    assert summary["comm_fraction"] == pytest.approx(6 / 12)
    assert summary["counted_bytes_per_step"] == pytest.approx(600 / 6)
    assert summary["wire_bytes_per_step"] == pytest.approx((2 * 330 + 4 * 10) / 6)
    assert summary["outer_wait_seconds_mean"] == pytest.approx(3.0)
    assert summary["outer_in_flight_seconds"] == pytest.approx(7.0)
    assert (summary["inner_step_seconds"], summary["outer_step_seconds"]) == (1.0, 4.0)


def test_round_summary_drops_a_partial_last_round_and_needs_a_whole_one():
    records = _local_step_records(rounds=4, every=3)
    partial = netem.round_summary(records[:-1], batch=8, every=3)
    assert (partial["steps"], partial["rounds"]) == (3, 1)
    with pytest.raises(RuntimeError, match="no whole round"):
        netem.round_summary(records[:8], batch=8, every=3)
    with pytest.raises(RuntimeError, match=r"steps \[8\]"):
        netem.round_summary(records[:7] + records[8:], batch=8, every=3)
    # a synchronous strategy never waits in the background
    sync = [{k: v for k, v in r.items() if not k.startswith("outer_")} for r in records]
    assert netem.round_summary(sync, batch=8, every=3)["outer_wait_seconds_mean"] is None


def test_local_step_runs_take_two_rounds_plus_whole_measured_rounds():
    assert netem.local_steps_total(4, 8) == 24
    assert netem.local_steps_total(4, 2) == 8
    assert netem.local_steps_total(5, 2) == 10


def test_result_row_relates_every_strategy_to_compute_only_and_lamb():
    lamb = {"samples_per_s": 10.0, "wall_samples_per_s": 9.0, "comm_fraction": 0.8,
            "counted_bytes_per_step": 800.0, "wire_bytes_per_step": 850.0}  # fmt: skip
    co2 = {**lamb, "samples_per_s": 38.0, "counted_bytes_per_step": 100.0, "outer_every": 8}
    compute = {"samples_per_s": 40.0, "wall_samples_per_s": 36.0}
    row = netem.result_row({"bandwidth_mbit": 25, "world_size": 4}, {"lamb": lamb, "co2": co2},
                           compute)  # fmt: skip
    assert row["compute_only_samples_per_s"] == 40.0 and row["lamb_samples_per_s"] == 10.0
    assert "onebit_samples_per_s" not in row and "speedup" not in row
    assert row["runs"]["co2"]["vs_compute_only"] == pytest.approx(0.95)
    assert row["runs"]["co2"]["wall_vs_compute_only"] == pytest.approx(0.25)
    assert row["runs"]["co2"]["counted_bytes_vs_lamb"] == pytest.approx(8.0)
    assert row["runs"]["lamb"]["counted_bytes_vs_lamb"] == pytest.approx(1.0)
    labels = [label for label, _ in netem.plot_series(row)]
    assert labels == ["LAMB", "CO2 (tau 8)", "compute only"]


def test_time_varying_graphs_are_averaged_not_medianed():
    # one-peer rounds alternate a one-way send (short) and a pairwise swap (long)
    records = [{"step": s, "time": 10.0 * s, "step_seconds": t, "comm_seconds": t - 1,
                "comm_bytes": 100} for s, t in enumerate([2.0, 4.0, 2.0, 8.0], 1)]  # fmt: skip
    median, mean = netem.summarize(records, 8), netem.summarize(records, 8, statistics.fmean)
    assert median["step_seconds"] == 3.0 and mean["step_seconds"] == 4.0
    assert mean["samples_per_s"] == 2.0 and mean["comm_seconds"] == 3.0


def test_slow_links_send_single_frames_and_fast_ones_whole_gso_packets():
    assert netem_cluster.gso_segments(25, 9000) == 1
    assert netem_cluster.gso_segments(100, 9000) == 1
    assert netem_cluster.gso_segments(1000, 9000) >= 7  # 64 KB: no cap
    assert netem_cluster.gso_segments(1000, 1500) == 83


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategies", "lamb,co3"], "--strategies: unknown 'co3'; choose from lamb, "),
        (["--strategies", ","], "--strategies: unknown (empty list)"),
        (["--strategies", "co2,co2"], "--strategies: each name once"),
        (["--strategies", "co2", "--outer-every", "0"], "--outer-every: each tau must be >= 1"),
        (["--strategies", "co2", "--outer-every", "4,diloco=8"], "diloco not in --strategies"),
        (["--strategies", "co2", "--outer-every", "4,co2=x"], "is not TAU or RECIPE=TAU"),
        (["--strategies", "lamb_node"], "need --ranks-per-host 2 or more"),
        (["--world-sizes", "3", "--ranks-per-host", "2"], "must divide every world size"),
        (["--strategies", "hybrid_onebit_lamb", "--hybrid-codec", "zip"], "--hybrid-codec"),
        (["--strategies", "decentlam", "--topologies", "ring,star"], "--topologies: 'ring,star'"),
        (["--strategies", "dmsgd", "--topologies", "ring,ring"], "a comma list of distinct"),
        (
            ["--strategies", "decentlam", "--world-sizes", "3"],
            "--topologies one_peer_exponential on 3 hosts: strategy.topology "
            "one_peer_exponential needs a power-of-2 number of ranks",
        ),
    ],
)
def test_strategy_arguments_are_checked_first(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        netem.main([*argv, "--data", "/nonexistent"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_without_root_it_says_so_and_exits(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as exit_info:
        netem.main(["--data", "/nonexistent"])
    assert exit_info.value.code == 2
    assert "needs root" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
def test_two_hosts_two_steps(tiny_corpus, tmp_path):
    before_ns, before_links = _netns_names(), _links()
    out = tmp_path / "out"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.netem",
            "--data",
            str(tiny_corpus),
            "--model",
            "bert-tiny",
            "--batch",
            "8",
            "--bandwidths",
            "200",
            "--world-sizes",
            "2",
            "--steps",
            "2",
            "--warmup-steps",
            "1",
            "--freeze-step",
            "2",
            "--strategies",
            "lamb,onebit_lamb,co2,decentlam,onebit_adam,zero_one_adam,hybrid_onebit_lamb,"
            "onebit_lamb_overlap,powersgd",
            "--bucket-mb",
            "0.5",
            "--outer-every",
            "2",
            "--topologies",
            "ring",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary == json.loads((out / "netem.json").read_text())
    assert (out / "netem.png").stat().st_size > 1000
    (row,) = summary["results"]
    assert (row["bandwidth_mbit"], row["world_size"]) == (200, 2)
    for key in ("lamb_samples_per_s", "onebit_samples_per_s", "compute_only_samples_per_s"):
        assert row[key] > 0
    assert 0 < row["lamb_comm_fraction"] < 1
    assert row["speedup"] == pytest.approx(row["onebit_samples_per_s"] / row["lamb_samples_per_s"])
    # 1-bit LAMB's compression stage sends far fewer bytes, by both counts, and the
    # interface saw what the communicator counted (plus headers and acknowledgements).
    assert row["bytes_ratio"] > 5 and row["counted_bytes_ratio"] > 5
    for run in ("lamb_bytes_per_step", "onebit_bytes_per_step"):
        assert 0.95 < row[run]["wire_over_counted"] < 1.25, row[run]
    # CO2: one parameter all-reduce per round of 2 steps, so half LAMB's counted bytes
    assert set(row["runs"]) == {
        "lamb", "onebit_lamb", "co2", "decentlam/ring", "onebit_adam", "zero_one_adam",
        "hybrid_onebit_lamb", "onebit_lamb_overlap", "powersgd",
    }  # fmt: skip
    co2 = row["runs"]["co2"]
    assert (co2["steps"], co2["rounds"], co2["outer_every"]) == (2, 1, 2)
    assert co2["counted_bytes_vs_lamb"] == pytest.approx(2.0, rel=0.01)
    assert co2["samples_per_s"] > 0 and co2["vs_compute_only"] > 0
    assert co2["outer_wait_seconds_mean"] >= 0 and co2["outer_in_flight_seconds"] > 0
    # DecentLaM on a ring of two: one parameter vector to the one neighbour per step, what
    # LAMB's counted gradient all-reduce is, and it crosses eth0
    decentlam = row["runs"]["decentlam/ring"]
    assert decentlam["topology"] == "ring" and decentlam["momentum"] == 0.9
    assert decentlam["samples_per_s"] > 0
    assert decentlam["counted_bytes_vs_lamb"] == pytest.approx(1.0, rel=0.02)
    assert 0.95 < netem._bytes_per_step(decentlam)["wire_over_counted"] < 1.25, decentlam
    assert summary["topologies"] == ["ring"]
    # 1-bit Adam: full-precision warmup, then 1-bit momentum; 0/1 Adam: every kind of step,
    # the variance steps sending what LAMB's do, the local ones only the statistics
    onebit_adam = row["runs"]["onebit_adam"]
    assert (
        onebit_adam["warmup"]["counted_bytes_per_step"] > 5 * onebit_adam["counted_bytes_per_step"]
    )
    kinds = row["runs"]["zero_one_adam"]["kinds"]
    assert set(kinds) == {"variance", "compressed", "local", "sync"}
    lamb_bytes = row["runs"]["lamb"]["counted_bytes_per_step"]
    assert kinds["variance"]["counted_bytes_per_step"] == pytest.approx(lamb_bytes, rel=0.01)
    assert lamb_bytes > 5 * kinds["compressed"]["counted_bytes_per_step"]
    assert kinds["sync"]["counted_bytes_per_step"] > 10 * kinds["local"]["counted_bytes_per_step"]
    whole = summary["whole_run"]["2"]
    assert whole["max_steps"] > whole["freeze_step"] > 0 and whole["reduction"] > 1
    assert not _leaked(_netns_names() - before_ns) and not _leaked(_links() - before_links)
    # the comm layer's variants: int8 warmup gradients (a quarter of LAMB's bytes, then the
    # same 1-bit stage), the overlapped 1-bit stage (same bytes), PowerSGD's factors
    runs = row["runs"]
    hybrid, onebit = runs["hybrid_onebit_lamb"], runs["onebit_lamb"]
    assert hybrid["warmup"]["counted_bytes_per_step"] == pytest.approx(lamb_bytes / 4, rel=0.02)
    assert hybrid["counted_bytes_per_step"] == onebit["counted_bytes_per_step"]
    assert runs["onebit_lamb_overlap"]["counted_bytes_per_step"] == pytest.approx(
        onebit["counted_bytes_per_step"], rel=0.05
    )
    assert 0 < runs["powersgd"]["counted_bytes_per_step"] < lamb_bytes / 5
    whole, hybrid_whole = summary["whole_run"]["2"], summary["whole_run_hybrid"]["2"]
    assert hybrid_whole["strategy"] == "hybrid_onebit_lamb"
    assert hybrid_whole["reduction"] > 2 * whole["reduction"]


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
def test_two_hosts_of_two_ranks_compare_flat_and_node_hierarchy(tiny_corpus, tmp_path):
    """4 ranks as 2 hosts x 2: only inter-host traffic crosses eth0; the hierarchy sends a
    third of the flat ring's counted bytes across hosts (a 2-rank ring of half the
    gradients, against a 4-rank ring of all of them) and less on the wire. Measured twice
    (--repeats 2): two numbered rows of the point, one sweep id, one combined point."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "bench.netem", "--data", str(tiny_corpus), "--model",
            "bert-tiny", "--batch", "8", "--bandwidths", "200", "--world-sizes", "4",
            "--ranks-per-host", "2", "--steps", "2", "--warmup-steps", "1", "--strategies",
            "lamb,lamb_node", "--repeats", "2", "--out", str(out)]  # fmt: skip
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["repeats"] == 2 and summary["sweep_id"]
    rows = summary["results"]
    assert [r["repeat"] for r in rows] == [0, 1]
    assert all(list(r["runs"]) == ["lamb", "lamb_node"] for r in rows)  # listed order kept
    from pipeline.reports.timing import combine_repeats

    (row,) = combine_repeats(rows)
    assert row["repeats"] == 2
    assert row["runs"]["lamb"]["samples_per_s_repeats"] == [
        r["runs"]["lamb"]["samples_per_s"] for r in rows
    ]
    assert (row["world_size"], row["hosts"], row["ranks_per_host"]) == (4, 2, 2)
    flat, node = row["runs"]["lamb"], row["runs"]["lamb_node"]
    assert flat["counted_bytes_per_step"] == pytest.approx(
        3 * node["counted_bytes_per_step"], rel=0.01
    )
    assert node["wire_bytes_per_step"] < flat["wire_bytes_per_step"]
    assert node["samples_per_s"] > 0 and row["compute_only_samples_per_s"] > 0


def test_outer_every_takes_a_default_and_each_recipes_own():
    from bench.netem import DEFAULT_OUTER_EVERY, parse_outer_every

    assert parse_outer_every("4,streaming_diloco_node=12") == (4, {"streaming_diloco_node": 12})
    assert parse_outer_every("8") == (8, {})
    assert parse_outer_every("diloco=4") == (DEFAULT_OUTER_EVERY, {"diloco": 4})
    for bad, message in [("4,5", "one default"), ("co2=2,co2=4", "given twice")]:
        with pytest.raises(ValueError, match=message):
            parse_outer_every(bad)


def test_inner_names_an_open_recipes_searched_optimizer():
    from bench.netem import parse_inner

    assert parse_inner("") == {}
    assert parse_inner("slowmo_node=adamw, co2_node=lamb") == {
        "slowmo_node": "adamw",
        "co2_node": "lamb",
    }
    for bad, message in [
        ("slowmo_node", "not RECIPE=OPTIMIZER"),
        ("slowmo_node=adamw,slowmo_node=lamb", "given twice"),
        ("slowmo=adamw", "not a recipe whose inner optimizer is open"),
        ("slowmo_node=sgd", "its search space offers lamb, adamw"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_inner(bad)


def test_a_process_killed_by_a_signal_is_reported_by_its_signal_and_stops_the_others(tmp_path):
    abort = [sys.executable, "-c", "import os, sys; print('step 1', flush=True); os.abort()"]
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"process 1 .* failed with signal SIGABRT:\n.*step 1"):
        netem_cluster._launch([sleeper, abort], [dict(os.environ)] * 2, tmp_path / "logs", 60)
    assert time.monotonic() - started < 30  # the sleeper was killed, not waited for


def test_a_stopped_sweep_resumes_its_rows_and_keeps_its_sweep_id(tiny_corpus, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    """After each measured row the rows so far are kept in --out; the same command again
    measures only the rest under the first invocation's sweep id, and other settings are
    refused. The cluster and the runs are stood in for: this checks the bookkeeping."""
    measured: list[tuple] = []

    class FakeCluster:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_measure(cluster, data, work, args, bandwidth, order, repeat):
        if len(measured) == stop_after:
            raise KeyboardInterrupt("stopped")
        measured.append((repeat, bandwidth))
        runs = {name: {"samples_per_s": bandwidth / 10 + repeat} for name in order}
        return {"bandwidth_mbit": bandwidth, "world_size": 4, "threads_per_rank": 1,
                "runs": runs}  # fmt: skip

    for name, value in (("check_privileges", lambda: None), ("Cluster", FakeCluster),
                        ("measure", fake_measure), ("remove_stale_clusters", lambda: []),
                        ("_terminate_on_sigterm", lambda: None), ("plot", lambda rows, p: None),
                        ("_parameter_count", lambda model, data: 1000)):  # fmt: skip
        monkeypatch.setattr(netem, name, value)
    out = tmp_path / "out"
    argv = ["--data", str(tiny_corpus), "--bandwidths", "25,100", "--world-sizes", "4",
            "--ranks-per-host", "2", "--strategies", "lamb,adamw", "--repeats", "2",
            "--out", str(out)]  # fmt: skip
    stop_after = 3  # of 4 rows: (repeat 0: 25, 100), (repeat 1: 25, 100)
    with pytest.raises(KeyboardInterrupt):
        netem.main(argv)
    partial = json.loads((out / netem.PARTIAL).read_text())
    assert len(partial["rows"]) == 3 and not (out / "netem.json").exists()
    first_id = partial["sweep_id"]
    # other settings: refused before anything runs
    with pytest.raises(SystemExit):
        netem.main([*argv[:-2], "--steps", "5", "--out", str(out)])
    assert len(measured) == 3
    stop_after = None
    summary = netem.main(argv)
    assert measured == [(0, 25.0), (0, 100.0), (1, 25.0), (1, 100.0)]  # the last one once
    assert summary["sweep_id"] == first_id and summary["resumed_rows"] == 3
    assert [(r["repeat"], r["bandwidth_mbit"]) for r in summary["results"]] == [
        (0, 25.0), (0, 100.0), (1, 25.0), (1, 100.0)]  # fmt: skip
    assert all(r["measured_at"] and r["host"] for r in summary["results"])
    assert not (out / netem.PARTIAL).exists()
    assert json.loads((out / "netem.json").read_text())["sweep_id"] == first_id
    # a new invocation starts a new sweep
    fresh = netem.main(argv)
    assert fresh["sweep_id"] != first_id and fresh["resumed_rows"] == 0
