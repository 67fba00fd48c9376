"""Tests for the benchmark helpers in bench/: rss.PeakRSS and hf_mlm_baseline."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shlex
import subprocess
import sys
from unittest.mock import patch

import pytest
import torch

from bench.hf_mlm_baseline import run_hf_mlm_baseline
from bench.rss import PeakRSS
from tests.helpers.compilers import NEEDS_CXX
from tests.helpers.paths import REPO, SHARED_DATA

VOCAB = SHARED_DATA / "bert_vocab" / "uncased" / "vocab.txt"

_VOCABULARY = (
    "the a of and to in is was for on with as by at from that this it river mountain city "
    "house garden winter summer music history school library bridge market village quickly "
    "slowly green old new small large ancient famous built wrote played discovered"
)
WORDS = _VOCABULARY.split()

# A grandchild (child of a child) that touches ~200 MB, reports, and holds it for a while.
_ALLOC = "import sys, time; b = b'x' * (200 << 20); print('ready', flush=True); time.sleep(0.6)"
_PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_ALLOC!r}], check=True)"


def test_peak_rss_sees_descendant_allocation():
    with PeakRSS(interval=0.05) as rss:
        out = subprocess.run(
            [sys.executable, "-c", _PARENT], check=True, capture_output=True, text=True
        ).stdout
    assert "ready" in out
    assert rss.samples >= 3
    assert rss.peak_mb - rss.start_mb >= 150, (rss.start_mb, rss.peak_mb)


def test_peak_rss_counts_this_process():
    with PeakRSS() as rss:
        pass
    assert rss.samples >= 2
    assert 0 < rss.start_mb <= rss.peak_mb


def _expected_blocks(lengths: list[int], block_size: int, num_proc: int, batch: int = 1000):
    """Blocks run_mlm's group_texts yields: contiguous shards per worker, batches of `batch`
    rows within a shard, each batch's remainder dropped (mirrors Dataset.shard/map)."""
    n, blocks = len(lengths), 0
    div, mod = divmod(n, num_proc)
    for i in range(num_proc):
        start = div * i + min(i, mod)
        shard = lengths[start : start + div + (1 if i < mod else 0)]
        for j in range(0, len(shard), batch):
            blocks += sum(shard[j : j + batch]) // block_size
    return blocks


def test_hf_mlm_baseline_counts(tmp_path):
    if not VOCAB.is_file():
        pytest.skip(f"shared BERT vocab not found at {VOCAB} (set SHARED_DATA)")
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    tok_dir = tmp_path / "tokenizer"
    # transformers 5 ignores a vocab_file argument; build from the tokenizers object.
    wordpiece = BertWordPieceTokenizer(str(VOCAB), lowercase=True)
    tokenizer = BertTokenizerFast(tokenizer_object=wordpiece._tokenizer, do_lower_case=True)
    assert len(tokenizer) == 30522
    tokenizer.save_pretrained(str(tok_dir))

    # Seed picked so that the per-batch remainder drop costs a block (see the blocks check).
    rng = random.Random(3)
    lines = []
    for _ in range(400):  # some empty lines too: run_mlm keeps them ([CLS] [SEP] each)
        words = rng.choices(WORDS, k=0 if rng.random() < 0.1 else rng.randint(1, 40))
        line = " ".join(words)
        lines.append(line[:1].upper() + line[1:] + ("." if line else ""))
    text_file = tmp_path / "corpus.txt"
    text_file.write_text("\n".join(lines) + "\n", encoding="utf-8")

    block_size, num_proc = 64, 2
    result = run_hf_mlm_baseline(
        str(text_file), str(tok_dir), block_size=block_size, num_proc=num_proc
    )
    assert set(result) == {"tokens", "blocks", "seconds", "tokens_per_s", "peak_rss_mb"}

    lengths = [len(ids) for ids in tokenizer(lines)["input_ids"]]
    assert lengths.count(2) == sum(not line for line in lines) > 0
    assert result["tokens"] == sum(lengths)
    # Remainders are dropped per map batch (one batch per worker here), as in run_mlm.py.
    assert result["blocks"] == _expected_blocks(lengths, block_size, num_proc)
    assert 0 <= result["tokens"] // block_size - result["blocks"] < num_proc
    assert result["blocks"] == sum(lengths) // block_size - 1  # holds for this seed's data
    assert result["seconds"] > 0
    assert result["tokens_per_s"] == pytest.approx(result["tokens"] / result["seconds"], rel=0.02)
    assert result["peak_rss_mb"] > 0


def test_giant_document_benchmark_runs_small():
    from bench.giant_document import main

    result = main(["--mb", "0.3"])
    assert result["megabytes"] == 0.3 and result["train_rows"] > 0
    assert result["peak_rss_main_mb"] > 0 and result["seconds"] >= 0


CPU_DRY_RUN = (
    "--device cpu --model bert-tiny --precisions fp32 --compile off --impl reference "
    "--steps 1 --warmup-steps 2 --batch-size 8 --vocab-size 2000 --bandwidth-gbs 10"
)
"""bench.gpu on the CPU, a dry run of its plumbing at the smallest sizes."""


def test_gpu_benchmark_plumbing_runs_on_the_cpu(tiny_corpus, tmp_path):
    """bench/gpu.py's loops, timing, host-sync count, HF Trainer baseline, MFU and the
    optimizer's floor, on the CPU (its --device cpu dry run): every configuration yields
    its figures, 1-bit LAMB in its compression stage. A GPU is needed for the benchmark's
    real figures."""
    from bench import gpu

    parser = gpu.build_parser()
    args = parser.parse_args(shlex.split(CPU_DRY_RUN + " --repeats 2 --peak-tflops 1"))
    gpu.check_arguments(parser, args)
    runs = gpu.run_all({128: tiny_corpus}, tmp_path, args, gpu.Device("cpu"))
    assert [(r["loop"], r["optimizer"], r.get("impl")) for r in runs] == [
        ("hf_trainer", "adamw", None),
        ("ours", "lamb", "reference"),
        ("ours", "onebit_lamb", "reference"),
        ("ours", "adamw", "torch"),
    ]
    for run in runs:
        assert "error" not in run, run
        timed = 1 if run["loop"] == "hf_trainer" else 2
        assert run["samples_per_s"] > 0 and run["steps_timed"] == timed, run
        assert run["precision"] == "fp32" and run["compile"] is False
        assert run["seq_length"] == 128 and run["batch_size"] == 8
        assert run["clock"] == "perf_counter"
        assert run["peak_memory_gib"] is None  # no device memory counter on the CPU
        assert "profile" not in run  # only with --profile-steps
    ours = {r["optimizer"]: r for r in runs if r["loop"] == "ours"}
    assert ours["onebit_lamb"]["stage"] == "compression"
    assert ours["onebit_lamb"]["kernels_path"] == "reference"  # the path its steps took
    assert "kernels_path" not in ours["lamb"]
    for run in ours.values():
        assert run["ratio_vs_hf_trainer"] > 0
        assert run["host_syncs_per_step"] > 0  # the gradient norm, at least
        # on the CPU the sites are the operations that would wait on a GPU, counted
        sites = run["host_sync_sites"]
        assert sum(sites.values()) == run["host_syncs_per_step"]
        assert set(sites) <= {"aten::_local_scalar_dense", "aten::nonzero"}, sites
        assert run["mfu"] == run["model_tflops_per_s"] > 0 and run["peak_tflops"] == 1
        assert run["flop_formula"].startswith("6*N*T + 12*L*d*S*T")
        assert run["optimizer_step_ms"] > 0 and run["optimizer_floor_ms"] > 0
    params = ours["lamb"]["optimizer_params"]
    assert ours["lamb"]["optimizer_bytes_floor"] == 28 * params
    assert ours["onebit_lamb"]["optimizer_bytes_floor"] == int(56.5 * params)
    assert ours["lamb"]["optimizer_floor_ms"] == round(28 * params / 10e9 * 1000, 3)
    with pytest.raises(SystemExit):  # half precision is the GPU's
        gpu.check_arguments(parser, parser.parse_args(["--device", "cpu"]))
    with pytest.raises(SystemExit):  # the fused kernels need CUDA or the interpreter
        gpu.check_arguments(
            parser, parser.parse_args(shlex.split("--device cpu --precisions fp32"))
        )


def test_gpu_benchmark_switches_to_the_fused_kernels_in_separate_passes():
    from bench.yardstick import implementations, use_implementation
    from onebit_bert.optim import Lamb, OneBitLamb

    impls = ["reference", "fused", "fused-separate"]
    onebit = OneBitLamb([torch.nn.Parameter(torch.zeros(3))], freeze_step=1)
    lamb = Lamb([torch.nn.Parameter(torch.zeros(3))])
    assert implementations(onebit, impls) == impls
    assert implementations(lamb, impls) == ["reference", "fused"]  # nothing to keep apart
    chosen = []
    for impl in impls:
        with patch.object(OneBitLamb, "set_kernels", lambda self, k: chosen.append(k)):
            use_implementation(onebit, impl)
        chosen.append(onebit.expand_in_update)
    assert chosen == ["reference", True, "fused", True, "fused", False]


def test_gpu_benchmark_comparisons_are_ratios_of_one_invocation():
    from bench.yardstick import comparisons, model_flops

    def row(optimizer, impl, samples, ms):
        return dict(loop="ours", optimizer=optimizer, impl=impl, seq_length=128,
                    precision="bf16", compile=True, samples_per_s=samples,
                    optimizer_step_ms=ms)  # fmt: skip

    runs = [
        row("lamb", "reference", 100, 8),
        row("lamb", "fused", 110, 4),
        row("onebit_lamb", "reference", 60, 40),
        row("onebit_lamb", "fused", 99, 10),
    ]
    alone = [{"optimizer": "onebit_lamb", "impl": "reference", "optimizer_step_ms": 30},
             {"optimizer": "onebit_lamb", "impl": "fused", "optimizer_step_ms": 6}]  # fmt: skip
    (config, step) = comparisons(runs, alone)
    assert config["lamb_fused_over_reference_samples"] == 1.1
    assert config["onebit_lamb_optimizer_step_speedup"] == 4.0
    assert config["onebit_over_lamb_samples_reference"] == 0.6
    assert config["onebit_over_lamb_samples_fused"] == 0.9
    assert step == {"optimizer_alone": "onebit_lamb", "step_speedup_fused": 5.0}
    assert "onebit_lamb_in_update_over_separate_samples" not in config
    # with 1-bit LAMB's fused kernels in separate passes as well: fused over those
    runs.append(row("onebit_lamb", "fused-separate", 90, 12))
    alone.append({"optimizer": "onebit_lamb", "impl": "fused-separate", "optimizer_step_ms": 9})
    (config, in_update, step) = comparisons(runs, alone)
    assert config["onebit_lamb_in_update_over_separate_samples"] == 1.1
    assert config["onebit_lamb_in_update_step_speedup"] == 1.2
    assert in_update == {"optimizer_alone": "onebit_lamb", "step_speedup_in_update": 1.5}

    from pretrain.config import ModelConfig
    from pretrain.model import build_model

    model = build_model(ModelConfig(preset="bert-tiny"), 64)
    flops = model_flops(model, batch=4, seq_length=32)
    n = sum(p.numel() for p in model.bert.encoder.parameters())
    assert flops["model_flops_per_step"] == 6 * n * 128 + 12 * 2 * 128 * 32 * 128


def test_gpu_benchmark_needs_no_data_outside_the_repository(capsys, tmp_path):
    """bench-gpu's default corpus is generated, prepared at both sequence lengths, and the
    model padded to BERT's vocabulary whatever the tokenizer learned (CPU dry run); with
    --rows-out the rows are also written as they finish."""
    from bench import gpu

    rows = tmp_path / "rows.jsonl"
    status = gpu.main(
        shlex.split(
            "--device cpu --model bert-tiny --precisions fp32 --compile off --steps 1 "
            "--warmup-steps 2 --batch-size 8 --optimizers lamb --no-hf-baseline "
            f"--impl reference --repeats 1 --rows-out {rows}"
        )
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [json.loads(line) for line in rows.read_text().splitlines()] == summary["runs"]
    assert status == 0 and summary["failures"] == 0
    assert summary["corpus"] == "generated" and summary["seq_lengths"] == [128, 512]
    assert not any(r["packing"] for r in summary["runs"])
    assert summary["tokenizer_vocab_size"] < summary["model_vocab_size"] == 30522
    assert [(r["seq_length"], r["batch_size"]) for r in summary["runs"]] == [(128, 8), (512, 2)]
    assert all(r["samples_per_s"] > 0 for r in summary["runs"])
    assert summary["reference"]["sequences_per_s_per_gpu"] == {"128": 580, "512": 210}
    assert summary["bandwidth_gbs"] > 0 and summary["impls"] == ["reference"]
    (alone,) = summary["optimizer_steps"]  # LAMB's step alone, on the preset's parameters
    assert alone["optimizer"] == "lamb" and alone["optimizer_step_ms"] > 0
    assert alone["optimizer_vs_floor"] > 0 and alone["steps_timed"] == 1


@pytest.mark.slow
def test_gpu_benchmark_alternates_reference_and_fused_kernels_in_the_interpreter():
    """bench/gpu.py with --impl reference,fused on the CPU, the fused kernels in Triton's
    interpreter (a child process: Triton fixes its mode at import): both implementations
    alternate on one trainer and are compared. LAMB only: the interpreter takes about
    half a minute per fused step of bert-tiny on 2 cores (1-bit LAMB's: several)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = (
        "--device cpu --model bert-tiny --precisions fp32 --compile off --steps 1 "
        "--warmup-steps 2 --repeats 1 --batch-size 4 --vocab-size 6500 --seq-lengths 128 "
        "--optimizers lamb --no-hf-baseline --no-optimizer-steps --impl reference,fused"
    )
    out = subprocess.run(
        [sys.executable, "-m", "bench.gpu", *shlex.split(command)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-5000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(r["optimizer"], r["impl"]) for r in summary["runs"]] == [
        ("lamb", "reference"),
        ("lamb", "fused"),
    ]
    assert all(r["samples_per_s"] > 0 and r["optimizer_step_ms"] > 0 for r in summary["runs"])
    (config,) = summary["comparisons"]
    assert config["lamb_fused_over_reference_samples"] > 0


def test_checkpoint_io_bench_saves_loads_and_reports_rates(tmp_path):
    from bench import checkpoint_io

    result = checkpoint_io.measure(tmp_path / "ckpt", scale=0.001, repeats=2)
    params = int(checkpoint_io.BERT_LARGE_PARAMS * 0.001)
    assert result["bytes"]["shared"] == 3 * 4 * params
    assert result["bytes"]["per_rank"] == int(checkpoint_io.ERROR_FEEDBACK_BYTES * 0.001) // 4 * 4
    assert len(result["save_seconds"]) == len(result["load_seconds"]) == 2
    assert result["save_gb_per_s"] > 0 and result["load_gb_per_s"] > 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000002"]


def test_finetune_loop_benchmark_times_both_loops():
    from bench import finetune_loop

    result = finetune_loop.main(
        ["--model", "bert-tiny", "--examples", "32", "--length", "16", "--batch", "16"]
        + ["--repeats", "1"]
    )
    assert set(result["seconds"]) == {"ours", "hf_trainer"}
    assert all(len(v) == 1 and v[0] > 0 for v in result["seconds"].values())
    assert result["hf_trainer_over_ours"] > 0


@pytest.mark.slow
def test_onebit_tensor_bench_times_three_ways_with_the_same_numbers():
    from bench.onebit_tensor import main, tensor_sizes
    from pretrain.config import ModelConfig
    from pretrain.model import build_model

    model = build_model(ModelConfig(preset="bert-tiny"), 64)
    assert tensor_sizes("bert-tiny", 64) == [p.numel() for p in model.parameters()]
    out = main(["--model", "bert-tiny", "--vocab-size", "64", "--world-size", "2",
                "--iters", "1", "--warmup", "0"])  # fmt: skip
    assert out["identical"] is True
    assert out["collectives_fused"] == out["collectives_per_tensor"] == 2
    assert out["collectives_one_by_one"] == 2 * out["tensors"]
    assert out["bytes_per_rank_per_tensor"] == out["bytes_per_rank_one_by_one"]
    assert out["bytes_per_rank_fused"] <= out["bytes_per_rank_per_tensor"]


def test_gloo_benchmarks_refuse_a_single_rank_while_parsing(capsys):
    from bench.onebit_tensor import main

    with pytest.raises(SystemExit) as exc:
        main(["--world-size", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--world-size: must be at least 2 (one rank sends nothing), not 1" in err


def test_gpu_benchmark_times_packed_sequences_beside_padded_ones(tiny_corpus, tmp_path):
    """--packing both: our loop with and without data.packing, one row each (CPU dry run;
    what packing gains is the GPU's figure)."""
    from bench import gpu

    command = CPU_DRY_RUN + " --repeats 1 --optimizers lamb --no-hf-baseline --packing both"
    parser = gpu.build_parser()
    args = parser.parse_args(shlex.split(command))
    gpu.check_arguments(parser, args)
    runs = gpu.run_all({128: tiny_corpus}, tmp_path, args, gpu.Device("cpu"))
    assert [(r["optimizer"], r["packing"]) for r in runs] == [("lamb", False), ("lamb", True)]
    assert all("error" not in r and r["samples_per_s"] > 0 for r in runs)


@pytest.mark.parametrize(
    "name, category",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
        ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_nn", "gemm"),
        ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_64x64_32x6_tn_align4>(...)", "gemm"),
        ("aten::addmm", "gemm"),
        ("aten::mm", "gemm"),
        ("void pytorch_flash::flash_fwd_kernel<...>", "attention"),
        ("fmha_cutlassB_f32_aligned_64x64_k64_sm80(PyTorchMemEffAttention::...)", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("c10d::allreduce_", "communication"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "other"),
        ("triton_poi_fused_add_mul_0", "other"),
        ("triton_poi_fused_addmm_gelu_1", "other"),  # Inductor's bias and GELU after a GEMM
        ("aten::broadcast_tensors", "other"),
        ("aten::add_", "other"),
    ],
)
def test_step_profile_classifies_kernel_and_op_names(name, category):
    from bench.step_profile import classify

    assert classify(name) == category


PROFILE_CATEGORIES = ("gemm", "attention", "communication", "optimizer", "other", "idle")


def test_step_profile_counts_kernels_launched_in_the_optimizer_step_as_its_own():
    """The CUDA attribution, on events made by hand as torch 2.13's profiler gives them: a
    kernel launched inside an ``Optimizer.step#`` range is the optimizer's, whether an aten
    op launched it (linked to that op) or it was launched bare, as Triton's are (found by
    its launch call's time); the GPU-side span of the range counts nothing; the rest goes
    by name. Op ids and CUDA correlation ids are separate counters that may coincide."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from bench.step_profile import device_work, summarise

    def event(id, name, start, end, kind, linked=0, cuda=False):
        made = FunctionEvent(
            id=id, name=name, thread=1, start_us=start, end_us=end,
            device_type=DeviceType.CUDA if cuda else DeviceType.CPU,
            is_user_annotation=kind.endswith("user_annotation"),
        )  # fmt: skip
        # set as torch 2.13's profiler sets them (older builds take neither as an argument)
        made.activity_type, made.linked_correlation_id = kind, linked
        return made

    step = event(1, "Optimizer.step#Lamb.step", 20, 60, "user_annotation")
    foreach = event(8, "aten::_foreach_add_", 22, 30, "cpu_op")  # id 8: the NCCL kernel's too
    step.append_cpu_child(foreach)
    foreach.set_cpu_parent(step)
    events = [
        event(2, "aten::mm", 0, 10, "cpu_op"),
        event(5, "cudaLaunchKernel", 2, 4, "cuda_runtime", linked=2),
        step,
        foreach,
        event(6, "cudaLaunchKernel", 24, 26, "cuda_runtime", linked=8),
        event(7, "cuLaunchKernel", 40, 42, "cuda_driver"),  # bare: no op to link to
        event(8, "cudaLaunchKernel", 64, 65, "cuda_runtime"),
        event(5, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 5, 15, "kernel", linked=2, cuda=True),
        event(6, "multi_tensor_apply_kernel<...>", 30, 33, "kernel", linked=8, cuda=True),
        event(7, "lamb_update", 45, 50, "kernel", cuda=True),
        event(9, "Optimizer.step#Lamb.step", 30, 50, "gpu_user_annotation", cuda=True),
        event(8, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 66, 76, "kernel", cuda=True),
    ]
    work = device_work(events)
    assert [(name[:8], category) for name, category, _ in work] == [
        ("sm90_xmm", "gemm"),
        ("multi_te", "optimizer"),
        ("lamb_upd", "optimizer"),
        ("ncclDevK", "communication"),
    ]
    profile = summarise(work, wall_ms=0.1, steps=1, source="cuda kernels")
    gpu = {"gemm": 0.01, "communication": 0.01, "optimizer": 0.008, "idle": 0.072}
    assert profile["categories"] == {**dict.fromkeys(PROFILE_CATEGORIES, 0.0), **gpu}
    assert profile["busy_ms_per_step"] == 0.028 and profile["shares"]["idle"] == 0.72
    assert [entry["ms_per_step"] for entry in profile["top"]] == [0.01, 0.01, 0.005, 0.003]
    # as older torch builds give them: no activity type, no link, the GPU-side span of
    # the range unflagged; the launch calls' names and times still find the optimizer's
    for e in events:
        del e.activity_type, e.linked_correlation_id
        if e.device_type == DeviceType.CUDA:
            e.is_user_annotation = False
    assert device_work(events) == work


def test_gpu_benchmark_profiles_steps_on_the_cpu(tiny_corpus, tmp_path):
    """--profile-steps: each row of our loop carries where its profiled steps' time went
    (the CPU's op self times in the dry run), the optimizer's step counted on its own."""
    from bench import gpu

    parser = gpu.build_parser()
    command = CPU_DRY_RUN + " --optimizers lamb,onebit_lamb --no-hf-baseline --repeats 1"
    args = parser.parse_args(shlex.split(command + " --profile-steps 1"))
    gpu.check_arguments(parser, args)
    runs = gpu.run_all({128: tiny_corpus}, tmp_path, args, gpu.Device("cpu"))
    assert [r["optimizer"] for r in runs] == ["lamb", "onebit_lamb"]
    for run in runs:
        assert "error" not in run, run
        profile = run["profile"]
        assert "error" not in profile, profile
        assert profile["steps"] == 1 and profile["source"] == "cpu ops, self time"
        categories, wall = profile["categories"], profile["wall_ms_per_step"]
        assert tuple(categories) == PROFILE_CATEGORIES
        assert all(ms >= 0 for ms in categories.values()), categories
        assert categories["gemm"] > 0 and categories["optimizer"] > 0, categories
        busy = profile["busy_ms_per_step"]
        assert busy == pytest.approx(sum(categories.values()) - categories["idle"], rel=1e-3)
        assert busy + categories["idle"] >= wall * 0.999
        shares = sum(profile["shares"].values())
        assert shares == pytest.approx(sum(categories.values()) / wall, rel=0.01)
        top = [entry["ms_per_step"] for entry in profile["top"]]
        assert 0 < len(top) <= 12 and top == sorted(top, reverse=True)
        assert all(entry["calls_per_step"] > 0 for entry in profile["top"])
    assert parser.parse_args([]).profile_steps == 0  # without the option, no profile
    with pytest.raises(SystemExit):
        gpu.check_arguments(parser, parser.parse_args(shlex.split(command + " --profile-steps -1")))
    missing = ["--rows-out", str(tmp_path / "missing" / "rows.jsonl")]
    with pytest.raises(SystemExit):  # refused before anything runs, not after the first rows
        gpu.check_arguments(parser, parser.parse_args([*shlex.split(command), *missing]))


@pytest.mark.slow
@NEEDS_CXX
def test_gpu_benchmark_compiles_the_body_as_model_compile_does(tiny_corpus, tmp_path):
    """--compile on: our loop trains with model.compile in --compile-mode (the BERT body
    compiled by Inductor, on the CPU here), and the row says which mode."""
    from torch._dynamo.utils import counters

    from bench import gpu

    command = CPU_DRY_RUN.replace("--compile off", "--compile on --compile-mode reduce-overhead")
    command += " --repeats 1 --optimizers lamb --no-hf-baseline"
    parser = gpu.build_parser()
    args = parser.parse_args(shlex.split(command))
    gpu.check_arguments(parser, args)
    counters.clear()
    (run,) = gpu.run_all({128: tiny_corpus}, tmp_path, args, gpu.Device("cpu"))
    assert "error" not in run and run["samples_per_s"] > 0, run
    assert run["compile"] is True and run["compile_mode"] == "reduce-overhead"
    assert counters["stats"]["unique_graphs"] >= 1


GPU_CHECK = REPO / "bench" / "gpu_check.sh"


def _gpu_check_invocations() -> tuple[list[list[str]], list[tuple[str, int, int]]]:
    """The bench.gpu argument lists bench/gpu_check.sh runs (its COMMON array with each
    ``bench NAME CAP RESERVE ...`` line, and the packing call), and each bench line's
    name, cap and reserve."""
    import re

    text = GPU_CHECK.read_text().replace("\\\n", " ")
    common = shlex.split(re.search(r"^COMMON=\((.*?)\)", text, re.M | re.S).group(1))
    steps = re.findall(r"^bench +(\S+) +(\d+) +(\d+) (.*)$", text, re.M)
    calls = [common + shlex.split(rest) for *_, rest in steps]
    packing = re.search(r'"\$PY" -m bench\.gpu (--prepared .*?)\s+>', text, re.S)
    calls.append(shlex.split(packing.group(1)))
    return calls, [(name, int(cap), int(reserve)) for name, cap, reserve, _ in steps]


def _gpu_check_limit(elapsed: int, cap: int, reserve: int) -> int:
    """What the script's own ``limit`` function gives a step ``elapsed`` seconds in."""
    import re

    function = re.search(r"^limit\(\) \{.*?^\}", GPU_CHECK.read_text(), re.M | re.S).group(0)
    # one clock for both readings: a second ticking between them would shorten the limit
    clock = "now=$(command date +%s)\ndate() { echo $now; }"
    script = f"{function}\n{clock}\nstarted=$((now - {elapsed}))\nlimit {cap} {reserve}"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_the_prepared_gpu_script_calls_bench_gpu_with_arguments_it_takes(tmp_path):
    """A GPU is lent for minutes: every bench.gpu call in bench/gpu_check.sh parses and
    passes bench.gpu's own checks (with the fused kernels, as on a GPU), and the timed
    steps fit the script's 570-second plan, which leaves a 10-minute call room to
    prepare the data."""
    import re

    from bench import gpu
    from onebit_bert.kernels import triton_available

    calls, limits = _gpu_check_invocations()
    assert len(calls) == 4, calls  # eager, compiled at 128 and 512, packing
    parser = gpu.build_parser()
    seen = set()
    for argv in calls:
        # $OUT: the folder the script makes before any call
        argv = [a.replace("$DATA", "/nonexistent").replace("$OUT", str(tmp_path)) for a in argv]
        args = parser.parse_args(argv)
        assert args.precisions == ["bf16"] and args.device == "cuda"
        assert str(args.prepared) == "/nonexistent"
        seen.update((args.compile, n) for n in args.seq_lengths)
        if args.compile == "on":  # one GPU run returns the compiled steps' profiles
            assert args.profile_steps > 0, argv
            assert args.impl == ["reference", "fused"], argv
        elif "--packing" not in argv:  # eager: 1-bit LAMB's separate passes beside the rest
            assert args.impl == ["reference", "fused", "fused-separate"], argv
        if "fused" in args.impl and triton_available():
            gpu.check_arguments(parser, args)  # as on a GPU: Triton there, device CUDA
    # the targets' four cells: eager and compiled, at 128 and at 512
    assert {("off", "128"), ("off", "512"), ("on", "128"), ("on", "512")} <= seen
    # the plan: the CUDA tests (at most 210 s) and the data (about 10 s) first; then each
    # invocation's limit is its cap or what the 570 s leave after its reserve
    assert re.search(r"^timeout 210 .* -m pytest ", GPU_CHECK.read_text(), re.M)
    assert [name for name, *_ in limits] == ["eager", "compiled-128", "compiled-512"]

    def plan(tests: int) -> list[int]:
        """Each invocation's limit when each runs to its limit, the tests taking
        ``tests`` s and the data 10 s."""
        elapsed, out = tests + 10, []
        for _, cap, reserve in limits:
            out.append(_gpu_check_limit(elapsed, cap, reserve))
            elapsed += out[-1]
        return out + [_gpu_check_limit(elapsed, 90, 0)]  # what the packing call gets

    worst = plan(210)  # every invocation keeps the limit it had before the plan adapted
    assert worst[:3] == [120, 120, 110] and worst[3] <= 0, worst
    best = plan(60)  # what the tests leave goes to compiling
    assert best[:3] == [120, 200, 180] and best[3] <= 0, best
    # the packed rows get what the invocations before them left unused
    assert plan(0) == [120, 200, 200, 40]
    assert max(_gpu_check_limit(e, 200, 0) for e in (0, 500, 570, 600)) <= 200
    assert _gpu_check_limit(600, 200, 0) < 30  # past the plan: skipped, never unlimited


def _comparison(seq_length, compiled, onebit_fused):
    return {"seq_length": seq_length, "precision": "bf16", "compile": compiled,
            "onebit_over_lamb_samples_fused": onebit_fused}  # fmt: skip


def _row(optimizer, seq_length, compiled, **figures):
    return {"loop": "ours", "optimizer": optimizer, "impl": "fused", "seq_length": seq_length,
            "precision": "bf16", "compile": compiled, "packing": False, **figures}  # fmt: skip


def test_gpu_summary_judges_each_target_from_the_figures():
    """bench/gpu_summary.py's verdicts: at the thresholds a target is met, past them
    missed, and a configuration that was not measured says so."""
    from bench.gpu_summary import targets

    summary = {
        "runs": [
            _row("lamb", 128, True, mfu=0.45),
            _row("lamb", 512, True, mfu=0.6),  # another length: not the target's
            _row("onebit_lamb", 128, False, optimizer_vs_floor=2.0),
            _row("onebit_lamb", 512, False, optimizer_vs_floor=2.01),
        ],
        "comparisons": [
            _comparison(128, False, 0.95),
            _comparison(512, False, 0.949),
            _comparison(128, True, 1.2),
        ],
        "optimizer_steps": [
            {"optimizer": "onebit_lamb", "impl": "fused", "optimizer_vs_floor": 1.5},
            {"optimizer": "onebit_lamb", "impl": "reference", "optimizer_vs_floor": 9.0},
        ],
    }
    verdicts = {t["target"]: (t["value"], t["verdict"]) for t in targets([summary])}
    ratio = "1-bit LAMB / LAMB samples/s, fused, "
    assert verdicts[ratio + "eager, length 128"] == (0.95, "met")
    assert verdicts[ratio + "eager, length 512"] == (0.949, "missed")
    assert verdicts[ratio + "compiled, length 128"] == (1.2, "met")
    assert verdicts[ratio + "compiled, length 512"] == (None, "not measured")
    floor = "1-bit LAMB's compression step / its floor, fused (the worst row)"
    assert verdicts[floor] == (2.01, "missed")  # the reference's 9.0 is not the target's
    assert verdicts["LAMB's MFU, compiled, length 128 (the better implementation)"] == (
        0.45,
        "met",
    )
    assert {t["verdict"] for t in targets([])} == {"not measured"}  # nothing ran


def test_gpu_summary_gives_the_fused_steps_bandwidth_and_what_the_ratio_needs(tmp_path):
    """A fused step's counted bytes over its measured time, as GB/s and as a share of the
    bandwidth (none for the reference, whose traffic was not counted); for 1-bit LAMB in
    our loop, the bandwidth at which its extra bytes over LAMB's step fit the 0.95×
    target's allowance over LAMB's step of the same configuration."""
    from bench.gpu_summary import bandwidth_table, render
    from bench.yardstick import COUNTED_BYTES_PER_PARAMETER, optimizer_figures

    params = 10**9
    fused = optimizer_figures("onebit_lamb", [0.02, 0.01, 0.03], params, 4000.0, "fused")
    counted = COUNTED_BYTES_PER_PARAMETER[("onebit_lamb", "fused")]
    assert fused["optimizer_counted_bytes_per_parameter"] == counted
    assert fused["optimizer_effective_gbs"] == pytest.approx(counted * params / 0.02 / 1e9, abs=0.1)
    assert fused["optimizer_bandwidth_share"] == pytest.approx(counted / 0.02 / 4000, abs=1e-3)
    reference = optimizer_figures("onebit_lamb", [0.02], params, 4000.0, "reference")
    assert "optimizer_effective_gbs" not in reference and reference["optimizer_vs_floor"] > 0
    lamb_bytes = COUNTED_BYTES_PER_PARAMETER[("lamb", "fused")]
    lamb = _row("lamb", 128, True, step_seconds_median=0.0592, optimizer_params=params,
                **optimizer_figures("lamb", [0.004], params, 4000.0, "fused"))  # fmt: skip
    onebit = _row("onebit_lamb", 128, True, step_seconds_median=0.063, optimizer_params=params,
                  **fused)  # fmt: skip
    alone = {"optimizer": "onebit_lamb", "impl": "fused", **fused}
    summary = {"runs": [lamb, onebit], "optimizer_steps": [alone]}
    table = bandwidth_table([summary])
    needs = (counted - lamb_bytes) * params / (0.0592 * (1 / 0.95 - 1)) / 1e9
    gbs, share = fused["optimizer_effective_gbs"], fused["optimizer_bandwidth_share"]
    assert table[3] == (
        f"| 128, compiled | 1-bit LAMB | fused | 20.00 | {counted:.2f} | {gbs:,.0f} "
        f"| {100 * share:.1f} % | {needs:,.0f} |"
    )
    assert table[2].startswith("| 128, compiled | LAMB | fused | 4.00 |")
    assert table[2].endswith("| – |") and table[4].startswith("| alone |")
    # without LAMB's row in the same invocation nothing says what the target needs
    assert bandwidth_table([{"runs": [onebit]}])[2].endswith("| – |")
    (tmp_path / "bench-compiled-128.json").write_text(json.dumps(summary) + "\n")
    assert table[3] in render(tmp_path).split("## The fused steps' bandwidth")[1]


def _profiled(mfu, wall, **categories):
    """A compiled LAMB row at length 128 with a profile of ``categories`` (ms per step)."""
    from bench.step_profile import summarise

    work = [(f"kernel_{name}", name, 1000 * ms) for name, ms in categories.items()]
    profile = summarise(work, wall, 1, "cuda kernels")
    # 100 TFLOP per step against a peak of 1,000 TFLOP/s: 0.1 s at full rate
    return _row("lamb", 128, True, mfu=mfu, peak_tflops=1000.0, model_flops_per_step=1e14,
                profile=profile)  # fmt: skip


def test_gpu_summary_takes_a_profiled_mfu_apart(tmp_path):
    """MFU = the products' share of the step × their rate, from the profile's figures; the
    rest in milliseconds; the sentence under the targets only where the target is missed."""
    from bench.gpu_summary import mfu_explanation, mfu_parts, mfu_table, render

    row = _profiled(0.3, 400.0, gemm=150.0, attention=50.0, optimizer=30.0, other=120.0)
    parts = mfu_parts(row)
    assert parts["products_ms"] == 200.0
    assert parts["products_share"] == pytest.approx(0.5)
    assert parts["products_rate"] == pytest.approx(0.5)  # 100 TFLOP in 0.2 s of 1,000
    assert parts["mfu_in_profile"] == pytest.approx(parts["products_share"] * 0.5)
    assert parts["rest_ms"] == {"communication": 0.0, "optimizer": 30.0, "other": 120.0,
                                "idle": 50.0}  # fmt: skip
    table = mfu_table([{"runs": [row]}])
    assert table[2] == (
        "| 128 | compiled | LAMB | fused | 25.0 % | 50.0 % | 50.0 % | 0.00 | 30.00 | 120.00 "
        "| 50.00 |"
    )
    sentence = mfu_explanation([{"runs": [row]}])
    assert "30.0 % MFU timed, 25.0 % in the profile" in sentence
    assert "The rest of the step: other 120.0 ms, idle 50.0 ms, optimizer 30.0 ms." in sentence
    assert "45 % needs them to fill 90.0 % of the step" in sentence
    # the best MFU's row is the one explained; a met target, or no profile, explains nothing
    better = _profiled(0.4, 250.0, gemm=200.0, other=50.0)
    assert "(250.0 ms" not in sentence and "250.0 ms step" in mfu_explanation(
        [{"runs": [row, better]}]
    )
    assert mfu_explanation([{"runs": [_profiled(0.45, 250.0, gemm=200.0)]}]) is None
    assert mfu_parts({**row, "profile": {"error": "OutOfMemoryError"}}) is None
    assert mfu_parts({**row, "peak_tflops": None}) is None
    assert mfu_table([{"runs": [{**row, "profile": None}]}])[2:] == []
    (tmp_path / "bench-compiled-128.json").write_text(json.dumps({"runs": [row]}) + "\n")
    text = render(tmp_path)
    assert table[2] in text.split("## What the MFU is made of (profiled steps)")[1]
    assert text.endswith(f"What holds the MFU back: {sentence}\n")


def test_gpu_summary_renders_what_a_dry_run_wrote_and_names_what_is_missing(tiny_corpus, tmp_path):
    """The summary of a folder as bench/gpu_check.sh leaves it: one invocation's JSON (a
    CPU dry run with a profile), one that timed out before its JSON but after writing its
    rows (--rows-out; the line a kill cut short left out), one that left nothing, the
    test log's last line."""
    from functools import partial

    from bench import gpu
    from bench.gpu_summary import main
    from bench.yardstick import comparisons

    command = CPU_DRY_RUN + " --optimizers lamb,onebit_lamb --no-hf-baseline --repeats 1"
    parser = gpu.build_parser()
    args = parser.parse_args(shlex.split(command + " --profile-steps 1"))
    folder = tmp_path / "check"
    folder.mkdir()
    rows = folder / "bench-partial.rows.jsonl"
    done = partial(gpu.append_rows, rows)
    runs = gpu.run_all({128: tiny_corpus}, tmp_path / "runs", args, gpu.Device("cpu"), done)
    assert [json.loads(line) for line in rows.read_text().splitlines()] == runs
    with open(rows, "a") as out:
        out.write('{"loop": "ours", "optimi')  # a row the kill cut short
    summary = {"gpu": None, "torch": "x", "runs": runs, "comparisons": comparisons(runs, []),
               "optimizer_steps": []}  # fmt: skip
    (folder / "bench-eager.json").write_text(json.dumps(summary) + "\n")
    (folder / "bench-partial.json").write_text("")
    (folder / "bench-compiled-512.json").write_text("")
    (folder / "test-gpu.log").write_text("...\n=== 36 passed, 3 skipped in 80.1s ===\n")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(folder)]) == 0
    text = out.getvalue()
    assert "CUDA tests: 36 passed, 3 skipped in 80.1s" in text
    assert "`bench-compiled-512.json` holds no result (the invocation failed" in text
    assert "the 2 rows it finished are read from `bench-partial.rows.jsonl`" in text
    loop = text.split("## Our loop")[1].split("##")[0]
    assert loop.count("| 128 | eager |") == 4  # LAMB and 1-bit LAMB, from each invocation
    ratios = text.split("## Ratios within one invocation")[1].split("##")[0]
    want = round(runs[1]["samples_per_s"] / runs[0]["samples_per_s"], 3)
    assert ratios.count(f"| 128 | eager | {want:,.3f} | – |") == 2
    profile = text.split("## Where a step's time goes")[1].split("##")[0]
    assert profile.count("| 128 | eager |") == 4 and "aten::" in profile
    waits = text.split("## Where one step makes the host wait")[1].split("##")[0]
    assert waits.count("| 128 | eager |") == 2  # one per configuration, not per invocation
    assert "`aten::_local_scalar_dense` (" in waits
    assert text.count("| not measured |") == 6  # no fused kernels, nothing compiled


def test_kernel_compile_names_triton_types():
    from bench.kernel_compile import triton_type

    assert triton_type(torch.zeros(2)) == "*fp32"
    assert triton_type(torch.zeros(2, dtype=torch.uint8)) == "*u8"
    assert triton_type(torch.zeros(2, dtype=torch.int64)) == "*i64"
    assert (triton_type(3), triton_type(2**31), triton_type(0.5)) == ("i32", "i64", "fp32")
    assert triton_type(True) == "i1"
    with pytest.raises(TypeError, match="complex64"):
        triton_type(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.slow
def test_every_fused_kernel_compiles_for_the_gpus_the_project_rents():
    """bench/kernel_compile.py: every kernel of onebit_bert/kernels/triton_src (each
    ``@triton.jit`` function not named with a leading underscore) is launched by the
    recorded steps, and every launch signature compiles for sm_90 (H100, H200) down to
    the cubin, without a GPU."""
    pytest.importorskip("triton")
    import ast

    from onebit_bert.kernels import COMPILE_OPTIONS

    kernels = set()
    for path in (REPO / "onebit_bert" / "kernels" / "triton_src").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                kernels.add(node.name)
    out = subprocess.run(
        [sys.executable, "-m", "bench.kernel_compile", "--arch", "90"],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["failed"] == 0
    assert {k["kernel"] for k in result["kernels"]} == kernels
    assert all(k["cubin_bytes"] > 0 for k in result["kernels"])
    # every launch names its compiler options, so that no Triton's default decides them
    assert all(k["options"] == COMPILE_OPTIONS for k in result["kernels"])
    # with ALIGNED the element-wise kernels load and store 16 bytes at a time, and the
    # weights' groups (sizes multiples of 4, each tensor its own allocation) launch so
    aligned = [k for k in result["kernels"] if k["constexprs"].get("ALIGNED")]
    assert {k["kernel"] for k in aligned} == {
        "lamb_measure",
        "scaled_step",
        "onebit_fold",
        "onebit_fold_compensated",
        "onebit_measure",
        "onebit_measure_signs",
    }
    assert all(k["vector_loads"] > 0 and k["vector_stores"] > 0 for k in aligned), aligned
    launched = {k["kernel"] for k in aligned if k["launched"]}
    assert {"lamb_measure", "onebit_fold_compensated", "onebit_measure_signs"} <= launched
    # ptxas's report, where this Triton's ptxas is found: nothing spills to local memory
    reported = [k for k in result["kernels"] if "registers" in k]
    assert all(k["spill_store_bytes"] == 0 for k in reported), reported


@pytest.mark.slow
def test_kernel_bytes_counts_what_the_fused_steps_move_in_the_interpreter():
    """bench/kernel_bytes.py in its child process (Triton's interpreter): LAMB's fused
    step moves 40 bytes per parameter (read g, m, v, w and write m, v; then read m, v, w
    and write w), a little more for the pointer tables and the scalars, and 1-bit LAMB's
    compression step lies between its floor and 1.25 times it, every kernel counted; with the
    fold beside the momentum and the expansion in the update it moves 16 bytes per
    parameter fewer than with those passes on their own (``--separate-passes``), and the
    same when overlapped with the backward pass (``--overlap``)."""
    pytest.importorskip("triton")

    def counted(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "bench.kernel_bytes", "--model", "bert-tiny",
             "--vocab-size", "300", *extra],
            cwd=REPO, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])["steps"]

    lamb, onebit = counted()
    assert lamb["optimizer"] == "lamb" and 40 <= lamb["bytes_per_parameter"] < 40.5
    # what bench.gpu divides by a step's time for the kernels' bandwidth is this count
    from bench.yardstick import COUNTED_BYTES_PER_PARAMETER as COUNTED

    assert COUNTED[("lamb", "fused")] == pytest.approx(lamb["bytes_per_parameter"], abs=0.05)
    assert COUNTED[("onebit_lamb", "fused")] == pytest.approx(
        onebit["bytes_per_parameter"], abs=0.05
    )
    assert set(lamb["kernels"]) == {"lamb_measure", "scaled_step", "segment_reduce"}
    assert lamb["kernels"]["lamb_measure"]["written_per_parameter"] == 8.0  # m and v
    assert onebit["stage"] == "compression"
    assert onebit["kernels_path"] == "fused, expanded in the update"
    assert set(onebit["kernels"]) == {
        "onebit_fold_compensated",
        "encode",
        "onebit_measure_signs",
        "scaled_step",
        "segment_reduce",
    }
    # m, g and the worker's stored values read, the values x + e written over them (and
    # three sums per block of 2,048 elements)
    written = onebit["kernels"]["onebit_fold_compensated"]["written_per_parameter"]
    assert written == pytest.approx(4.0, abs=0.015)
    # the 1-bit all-reduce at one rank: the worker's signs of those values (read 4, write
    # 1/8) and the server's one pass (read and write its values, read and write signs)
    assert 12.25 < onebit["kernels"]["encode"]["bytes_per_parameter"] < 12.5
    assert 56.5 < onebit["bytes_per_parameter"] < 1.25 * 56.5
    parts = sum(k["bytes_per_parameter"] for k in onebit["kernels"].values())
    assert parts == pytest.approx(onebit["bytes_per_parameter"], abs=0.1)
    _, separate = counted("--separate-passes")
    assert separate["kernels_path"] == "fused"
    assert {"onebit_fold", "onebit_measure", "expand"} <= set(separate["kernels"])
    saved = separate["bytes_per_parameter"] - onebit["bytes_per_parameter"]
    assert 15.5 < saved < 16.5, saved
    assert COUNTED[("onebit_lamb", "fused-separate")] == pytest.approx(
        separate["bytes_per_parameter"], abs=0.05
    )
    # overlapped with the backward pass: the folds, parameter by parameter, sum the
    # worker's squares as the plain step's fold does (no pass of their own), and the error
    # figure comes from the kernels' sums, not from norms outside them
    _, overlapped = counted("--overlap")
    assert overlapped["overlapped"] and overlapped["kernels_path"] == onebit["kernels_path"]
    more = overlapped["bytes_per_parameter"] - onebit["bytes_per_parameter"]
    assert abs(more) < 0.1, more
    sums = [run["kernels"]["encode"]["bytes_per_parameter"] for run in (overlapped, onebit)]
    assert sums[0] == sums[1], sums
    assert {op["op"] for op in overlapped["outside_kernels"]} == {"aten::copy_"}
    # a refresh step (coeff_refresh) runs in the kernels too: fold, measure, step, and
    # outside them only the parameters' norms (the exact average is a no-op on one rank)
    _, refreshed = counted("--refresh")
    assert refreshed["refreshed"] and refreshed["kernels_path"] == "fused"
    assert set(refreshed["kernels"]) == {
        "onebit_fold",
        "onebit_measure",
        "scaled_step",
        "segment_reduce",
    }
    assert [op["op"] for op in refreshed["outside_kernels"]] == ["aten::_foreach_norm"]
    # outside the kernels: nothing for LAMB; for 1-bit LAMB only the message's bytes (an
    # eighth of an element each), copied for the exchange at one rank
    assert lamb["outside_kernels"] == []
    assert {op["op"] for op in onebit["outside_kernels"]} == {"aten::copy_"}
    assert all(op["elements"] < onebit["params"] / 7 for op in onebit["outside_kernels"])
    # on 2 gloo ranks the server's half runs on half the elements: less traffic, LAMB's same
    lamb2, onebit2 = counted("--world-size", "2")
    assert onebit2["world_size"] == 2 and onebit2["floor_bytes_per_parameter"] == 52.5
    assert lamb2["bytes_per_parameter"] == lamb["bytes_per_parameter"]
    assert onebit2["bytes_per_parameter"] < onebit["bytes_per_parameter"] - 2
