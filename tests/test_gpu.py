"""The CUDA path against the CPU one: each test runs the same computation on both devices.

``make test-gpu`` runs these (and fails at once on a machine without CUDA); ``make test``
skips the module there. Sign packing must match bit for bit. Whatever has a
floating-point reduction in it (norms, matrix products, sums over ranks) is compared
with tolerances: CUDA kernels sum in other orders than the CPU ones, and fuse multiplies
with adds. Two ranks share the one GPU over gloo, which carries CUDA tensors for the
collectives used here (all-reduce, all-to-all, all-gather, broadcast); NCCL refuses two
ranks on one device. Every run is fp32 unless it is about bf16 or fp16, so that CPU and
GPU results can be compared at all.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from onebit_bert.distributed.codecs import OneBitCodec, packing
from onebit_bert.distributed.codecs.packing import pack_signs, unpack_signs
from onebit_bert.distributed.comm import Communicator
from onebit_bert.kernels import triton_available, use_fused
from onebit_bert.metrics_log import read_metrics
from onebit_bert.optim import Lamb
from pretrain.config import ModelConfig
from pretrain.model import PretrainingLoss, build_model
from tests.helpers.compression import compressed_calls, per_tensor_calls, run_onebit_lamb
from tests.helpers.distributed_harness import run_ranks
from tests.helpers.kernel_checks import CHECKS
from tests.helpers.loss_scaling import OverflowOnce, fit_overflow_once, overflow_on_rank_one
from tests.helpers.nccl import every_collective
from tests.helpers.runs import mlm_losses, tiny_config, train_in_process
from tests.helpers.syncs import OURS, optimizer_step_syncs, training_step_syncs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (run with make test-gpu)"
    ),
]

GPU = "cuda:0"
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for 2 NCCL ranks")


def assert_states_close(got: dict, want: dict, **tolerance) -> None:
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, msg=name, **tolerance)


# ----------------------------------------------------------------------------- packing


@pytest.mark.parametrize("numel", [8, 104, 8 * 4097, 8 * 250_001])
def test_sign_packing_is_bit_identical_to_the_cpu(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[::7] = 0.0  # sign(0) = +1
    x[1::11] = -0.0
    x[2::13] = float("nan")  # not >= 0: packed as negative on both devices
    x[3::17] = float("inf")
    x[4::19] = float("-inf")
    on_cpu = pack_signs(x)
    on_gpu = pack_signs(x.to(GPU))
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), on_cpu)
    # Both packers, whichever of them pack_signs picked on this GPU.
    nonneg = (x.to(GPU) >= 0).contiguous()
    for packer in (packing._pack_by_multiply, packing._pack_by_shifts):
        assert torch.equal(packer(nonneg).cpu(), on_cpu), packer.__name__
    scale = torch.tensor(0.37)
    assert torch.equal(unpack_signs(on_gpu, scale.to(GPU)).cpu(), unpack_signs(on_cpu, scale))
    out = torch.empty(numel, device=GPU)
    unpack_signs(on_gpu, scale.to(GPU), out=out)
    assert torch.equal(out.cpu(), unpack_signs(on_cpu, scale))


# ----------------------------------------------------------------------------- 1-bit


@pytest.mark.parametrize(
    "world_size,numel,bucket", [(1, 1001, None), (2, 1001, 64), (2, 5000, None)]
)
def test_compressed_allreduce_on_cuda_matches_the_cpu(world_size, numel, bucket):
    # At world size 1 the communicator still compresses (the path forced compression takes).
    calls = 5
    on_cpu = run_ranks(compressed_calls, world_size, numel, calls, bucket)
    on_gpu = run_ranks(compressed_calls, world_size, numel, calls, bucket, device=GPU)
    for cpu, gpu in zip(on_cpu, on_gpu, strict=True):
        assert gpu["bytes"] == cpu["bytes"]
        for got, want in zip(gpu["outs"], cpu["outs"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert torch.all(got[numel:] == 0), "padding picked up a value"
        # An error element is x - s*sign(x): it is rounded relative to the scale s, not to
        # its own size (at world size 1 the server's error is rounding noise alone, about
        # 1e-6). Measured on an H100: at most 2.6e-6 apart for scales of 1.3 to 2.2. A
        # sign decided differently would put them 2s apart.
        scale = max(out.abs().max().item() for out in cpu["outs"])
        for key in ("worker_error", "server_error"):
            apart = (gpu[key] - cpu[key]).abs().max().item()
            assert apart <= 1e-5 * scale, f"{key}: {apart:.3g} apart, scale {scale:.3g}"
    for gpu in on_gpu[1:]:
        for a, b in zip(gpu["outs"], on_gpu[0]["outs"], strict=True):
            assert torch.equal(a, b), "ranks disagree"


@pytest.mark.parametrize("world_size,bucket", [(2, None), (2, 64), (4, 64)])
def test_per_tensor_compression_in_one_exchange_on_cuda_matches_the_cpu(world_size, bucket):
    # onebit_tensor (0/1 Adam's and 1-bit Adam's per-tensor scales) sends every tensor in
    # one all-to-all and one all-gather; on the GPU it must still equal each tensor sent
    # alone bit for bit, and the CPU within rounding.
    sizes, steps = (300, 7, 64, 1), 3
    on_cpu = run_ranks(per_tensor_calls, world_size, sizes, steps, bucket)
    on_gpu = run_ranks(per_tensor_calls, world_size, sizes, steps, bucket, device=GPU)
    for cpu, gpu in zip(on_cpu, on_gpu, strict=True):
        assert gpu["bytes"] == cpu["bytes"]
        for batched, alone in zip(gpu["batched"], gpu["alone"], strict=True):
            for a, b in zip(batched, alone, strict=True):
                assert torch.equal(a, b), "one exchange differs from one per tensor"
        for got_step, want_step in zip(gpu["batched"], cpu["batched"], strict=True):
            for got, want in zip(got_step, want_step, strict=True):
                scale = max(want.abs().max().item(), 1e-30)
                assert (got - want).abs().max().item() <= 1e-5 * scale
        assert gpu["errors"].keys() == cpu["errors"].keys()
    for a, b in zip(on_gpu[0]["batched"][-1], on_gpu[-1]["batched"][-1], strict=True):
        assert torch.equal(a, b), "ranks disagree"


@pytest.mark.parametrize("world_size", [1, 2])
def test_onebit_lamb_steps_on_cuda_match_the_cpu(world_size):
    # 3 warmup steps, then 5 compressed ones (compressing at world size 1 too), with a
    # momentum mask on one layer.
    steps, mask = 8, 2
    on_cpu = run_ranks(run_onebit_lamb, world_size, steps, mask, None)
    on_gpu = run_ranks(run_onebit_lamb, world_size, steps, mask, None, device=GPU)
    for cpu, gpu in zip(on_cpu, on_gpu, strict=True):
        assert gpu["stages"] == cpu["stages"] == ["warmup"] * 3 + ["compression"] * 5
        assert gpu["bytes"] == cpu["bytes"]
        for got, want in zip(gpu["params"], cpu["params"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gpu["factors"], cpu["factors"], rtol=1e-5, atol=1e-6)
        assert torch.all(gpu["masked_momentum"] == 0)
    for gpu in on_gpu[1:]:
        for a, b in zip(gpu["params"], on_gpu[0]["params"], strict=True):
            assert torch.equal(a, b), "replicas diverged"


# ----------------------------------------------------------------------------- fused kernels


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_fused_kernels_on_cuda_match_the_reference_on_the_cpu(check):
    # The interpreter runs the same checks in make test (tests/core/distributed/test_kernels.py).
    if not triton_available():
        pytest.fail("Triton is missing: torch's CUDA builds ship it (pip install '.[gpu]')")
    CHECKS[check](GPU)


def test_cuda_picks_the_fused_kernels_by_default():
    assert OneBitCodec(Communicator(None, device=GPU)).sign_ops.name == "fused"
    params = [torch.nn.Parameter(torch.randn(4, device=GPU))]
    assert Lamb(params).kernels == "auto" and use_fused(GPU, "auto")


@pytest.mark.parametrize("world_size", [1, 2])
def test_fused_onebit_lamb_on_cuda_matches_the_reference_on_cuda_and_the_cpu(world_size):
    steps, mask = 8, 2
    on_cpu = run_ranks(run_onebit_lamb, world_size, steps, mask, 64)
    args = (world_size, steps, mask, 64)
    reference = run_ranks(run_onebit_lamb, *args, "reference", device=GPU)
    fused = run_ranks(run_onebit_lamb, *args, "fused", device=GPU)
    for cpu, ref, new in zip(on_cpu, reference, fused, strict=True):
        assert new["stages"] == cpu["stages"] == ["warmup"] * 3 + ["compression"] * 5
        assert new["bytes"] == ref["bytes"] == cpu["bytes"]
        for got, want_gpu, want_cpu in zip(new["params"], ref["params"], cpu["params"],
                                           strict=True):  # fmt: skip
            torch.testing.assert_close(got, want_gpu, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, want_cpu, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new["factors"], cpu["factors"], rtol=1e-5, atol=1e-6)
        assert torch.all(new["masked_momentum"] == 0)
    for other in fused[1:]:
        for a, b in zip(other["params"], fused[0]["params"], strict=True):
            assert torch.equal(a, b), "replicas diverged"


# ----------------------------------------------------------------------------- precision


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    on_cpu = run_ranks(overflow_on_rank_one, 2)
    on_gpu = run_ranks(overflow_on_rank_one, 2, device=GPU)
    assert on_gpu == on_cpu == [(False, 512.0, 1), (False, 512.0, 1)]


def test_fine_tuning_in_fp16_skips_the_overflowing_step_and_trains_on():
    """HF Trainer's loss scale: the infinite first loss skips that step (torch's
    GradScaler), the weights stay finite and the later steps train; bf16 runs too."""
    model = OverflowOnce()
    losses = fit_overflow_once(model, "fp16", torch.device(GPU))
    assert model.calls == len(losses) == 4
    assert np.isinf(losses[0]) and np.all(np.isfinite(losses[1:]))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    bf16 = fit_overflow_once(OverflowOnce(), "bf16", torch.device(GPU))
    assert len(bf16) == 4 and np.isinf(bf16[0])


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_training_steps_track_fp32_on_the_cpu(tiny_corpus, tmp_path, precision):
    common = {"model.dropout": 0.0, "schedule.max_steps": 6}
    run_ranks(train_in_process, 1, tiny_config(tiny_corpus, tmp_path / "cpu", **common))
    half = tiny_config(tiny_corpus, tmp_path / precision, precision=precision, **common)
    summary = run_ranks(train_in_process, 1, half, device=GPU)[0]["summary"]
    assert summary["state"] == "complete" and summary["precision"] == precision
    fp32, low = mlm_losses(tmp_path / "cpu"), mlm_losses(tmp_path / precision)
    assert len(low) == 6 and np.all(np.isfinite(low))
    # The first step sees the same weights and batch: only the arithmetic differs.
    assert abs(low[0] - fp32[0]) < 0.05 * fp32[0], (low[0], fp32[0])
    records = [r for r in read_metrics(tmp_path / precision / "metrics.jsonl") if "loss" in r]
    if precision == "bf16":  # no loss scaling: every step updates, as on the CPU
        np.testing.assert_allclose(low, fp32, rtol=0.05)
        assert all(r["loss_scale"] == 1.0 and r["skipped_steps"] == 0 for r in records)
    else:  # every skipped (overflowed) step halved the scale from 2**16
        for r in records:
            assert r["loss_scale"] == 2.0**16 / 2 ** r["skipped_steps"]
        assert records[-1]["skipped_steps"] < len(records), "no step was ever applied"


# ----------------------------------------------------------------------------- the loop


# AdamW at its own learning rate; on CUDA it runs torch's fused kernel, on the CPU the
# default one.
LR = {"adamw": 1e-3}


@pytest.mark.parametrize("optimizer", ["lamb", "onebit_lamb", "adamw"])
def test_short_pretraining_with_ddp_and_accumulation_matches_the_cpu(
    tiny_corpus, tmp_path, optimizer
):
    # 2 ranks x 8 sequences x 2 accumulation steps = the global batch of 32.
    common = {
        "model.dropout": 0.0,
        "schedule.max_steps": 8,
        "optimizer.name": optimizer,
        "optimizer.lr": LR.get(optimizer, 0.02),
        "strategy.grad_sync": "ddp",
        "precision": "fp32",
    }
    on_cpu = run_ranks(train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "cpu", **common))
    on_gpu = run_ranks(
        train_in_process, 2, tiny_config(tiny_corpus, tmp_path / "gpu", **common), device=GPU
    )
    summary = on_gpu[0]["summary"]
    assert summary["state"] == "complete" and summary["accumulation"] == 2
    np.testing.assert_allclose(
        mlm_losses(tmp_path / "gpu"), mlm_losses(tmp_path / "cpu"), rtol=1e-4
    )
    for name, tensor in on_gpu[0]["model"].items():
        assert torch.equal(tensor, on_gpu[1]["model"][name]), f"replicas diverged: {name}"
    if optimizer != "onebit_lamb":
        # 1-bit LAMB is left at the losses: a momentum element within rounding of zero may
        # take the other sign on the other device, moving that one weight by a whole step.
        assert_states_close(on_gpu[0]["model"], on_cpu[0]["model"], rtol=1e-4, atol=1e-5)
    stages = [r["stage"] for r in read_metrics(tmp_path / "gpu" / "metrics.jsonl") if "stage" in r]
    if optimizer == "onebit_lamb":
        assert stages == ["warmup"] * 4 + ["compression"] * 4


@pytest.mark.parametrize("optimizer", ["lamb", "onebit_lamb", "adamw"])
def test_checkpoint_saved_on_cuda_resumes_on_cuda_and_on_the_cpu(tiny_corpus, tmp_path, optimizer):
    common = {
        "model.dropout": 0.0,
        "schedule.max_steps": 8,
        "optimizer.name": optimizer,
        "optimizer.lr": LR.get(optimizer, 0.02),
        "optimizer.freeze_step": 2,
        "strategy.force_compression": True,  # 1-bit LAMB compresses at world size 1
        "precision": "fp32",
    }
    straight = run_ranks(
        train_in_process,
        1,
        tiny_config(tiny_corpus, tmp_path / "cpu", **common),
    )[0]
    # Steps 1-4 on the GPU, a checkpoint at step 4 (in 1-bit LAMB's compression stage).
    first = tiny_config(tiny_corpus, tmp_path / "gpu", stop_after=4, **common)
    assert run_ranks(train_in_process, 1, first, device=GPU)[0]["summary"]["state"] == "stopped"
    shutil.copytree(tmp_path / "gpu", tmp_path / "gpu_then_cpu")
    rest = {
        "gpu": run_ranks(
            train_in_process, 1, tiny_config(tiny_corpus, tmp_path / "gpu", **common), device=GPU
        ),
        "gpu_then_cpu": run_ranks(
            train_in_process, 1, tiny_config(tiny_corpus, tmp_path / "gpu_then_cpu", **common)
        ),
    }
    want_losses = mlm_losses(tmp_path / "cpu")
    for name, (result,) in rest.items():
        assert result["summary"]["state"] == "complete" and result["summary"]["step"] == 8
        records = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [r["step"] for r in records if "loss" in r] == list(range(1, 9)), name
        np.testing.assert_allclose(
            mlm_losses(tmp_path / name), want_losses, rtol=1e-4, err_msg=name
        )
        if optimizer != "onebit_lamb":  # see the DDP test for why 1-bit LAMB stops there
            assert_states_close(result["model"], straight["model"], rtol=1e-4, atol=1e-5)
        else:
            stages = [r["stage"] for r in records if "stage" in r]
            assert stages == ["warmup"] * 2 + ["compression"] * 6, name


# ----------------------------------------------------------------------------- fast path


@pytest.mark.parametrize("name", [*OURS, "adamw"])
def test_optimizer_steps_make_no_host_sync_on_cuda(name):
    """torch's sync debug mode sees no wait in any optimizer's step, in any stage; AdamW
    runs torch's fused kernel."""
    counts, stages, optimizer = optimizer_step_syncs(name, GPU)
    assert counts == [0] * 8, optimizer.sync_sites
    if name == "adamw":
        assert optimizer.defaults["fused"] is True
    if name in ("onebit_lamb", "onebit_adam"):
        assert stages == ["warmup"] * 2 + ["compression"] * 6


def test_a_training_step_on_cuda_syncs_as_often_at_any_depth(tiny_corpus, tmp_path):
    """As on the CPU (tests/core/optim/test_host_syncs.py): a few waits per micro-batch and per
    step (there, also the statistics' copy to the host), the same for 2 and 4 layers,
    none per parameter."""
    tiny = training_step_syncs(tiny_corpus, tmp_path / "tiny", "bert-tiny", GPU)
    mini = training_step_syncs(tiny_corpus, tmp_path / "mini", "bert-mini", GPU)
    assert tiny == mini, (tiny, mini)
    micro_batches = 2
    assert all(0 < n <= 4 * micro_batches + 4 for n in tiny), tiny


def _mlm_batch(padded: bool) -> dict:
    gen = torch.Generator().manual_seed(3)
    rows, length = 4, 64
    input_ids = torch.randint(5, 100, (rows, length), generator=gen)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    if padded:
        attention_mask[:2, 48:] = 0
        input_ids[:2, 48:] = 0
    mlm_labels = torch.full((rows, length), -100)
    mlm_labels[:, 3:40:5] = input_ids[:, 3:40:5]
    batch = {
        "input_ids": input_ids,
        "token_type_ids": torch.zeros(rows, length, dtype=torch.long),
        "attention_mask": attention_mask,
        "mlm_labels": mlm_labels,
        "nsp_labels": torch.tensor([0, 1, 0, 1]),
    }
    return {k: v.to(GPU) for k, v in batch.items()}


@pytest.mark.parametrize("padded", [False, True])
def test_attention_runs_on_a_fused_sdpa_kernel(padded):
    """In bf16, a batch without padding runs flash attention (HF drops the all-ones mask)
    and a padded one flash or memory-efficient attention: never the unfused math kernel
    (sdpa_kernel raises when none of the kernels allowed can run). Losses and gradients
    equal the math kernel's."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("flash attention needs compute capability 8.0 (A100) or later")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    config = ModelConfig(preset="bert-tiny", max_position_embeddings=64, dropout=0.0)
    model = PretrainingLoss(build_model(config, vocab_size=100).to(GPU))
    batch = _mlm_batch(padded)
    fused = [SDPBackend.FLASH_ATTENTION]
    if padded:
        fused.append(SDPBackend.EFFICIENT_ATTENTION)
    results = {}
    for name, kernels in (("fused", fused), ("math", [SDPBackend.MATH])):
        model.zero_grad(set_to_none=True)
        with sdpa_kernel(kernels), torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = model(**batch)
        loss.backward()
        grad = model.model.bert.encoder.layer[0].attention.self.query.weight.grad.clone()
        results[name] = (loss.detach().float(), grad)
    assert torch.isfinite(results["fused"][0])
    torch.testing.assert_close(results["fused"][0], results["math"][0], rtol=2e-2, atol=2e-2)
    fused_grad, math_grad = results["fused"][1].float(), results["math"][1].float()
    assert (fused_grad - math_grad).norm() <= 0.05 * math_grad.norm()  # bf16: ~3 digits


def test_a_resumed_rank_draws_the_same_dropout_masks_on_its_gpu():
    from pretrain import checkpointing

    torch.cuda.manual_seed(5)
    state = checkpointing.rng_state()
    assert isinstance(state["cuda"], torch.Tensor)  # this GPU's generator only
    expected = torch.rand(4, device=GPU)
    checkpointing.set_rng_state(state)
    assert torch.equal(torch.rand(4, device=GPU), expected)
    older = {**state, "cuda": [state["cuda"]] * torch.cuda.device_count()}  # older files
    checkpointing.set_rng_state(older)
    assert torch.equal(torch.rand(4, device=GPU), expected)


# ----------------------------------------------------------------------------- NCCL


def assert_results_close(got: dict, want: dict) -> None:
    """Every result of tests/helpers/nccl.py's every_collective: integers exact, floats
    within CUDA's other summation order (matrix products, norms, QR)."""
    for key, value in want.items():
        if key in ("calls", "off_main_thread", "from_python_threads", "backend", "comm_seconds"):
            continue
        values = value if isinstance(value, list) else [value]
        others = got[key] if isinstance(got[key], list) else [got[key]]
        for a, b in zip(others, values, strict=True):
            if b.dtype.is_floating_point:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=key)
            else:
                assert torch.equal(a, b), key


def test_every_collective_on_a_one_rank_nccl_group_matches_gloo_on_the_cpu():
    # A one-rank group is not short-circuited: each call below really runs on NCCL.
    (nccl,) = run_ranks(every_collective, 1, backend="nccl")
    (gloo,) = run_ranks(every_collective, 1, backend="gloo")
    assert (nccl["backend"], gloo["backend"]) == ("nccl", "gloo")
    assert nccl["calls"] == gloo["calls"]
    assert "all_to_all_single" in nccl["calls"]
    assert nccl["comm_seconds"] > 0  # from CUDA events, resolved after a synchronisation
    assert_results_close(nccl, gloo)
    assert_nccl_threads(nccl)


def assert_nccl_threads(result: dict) -> None:
    """No collective from a thread Python started; CUDA futures complete at launch, so even
    PowerSGD's chained all-reduces come from the caller's thread. Only DDP's hook runs
    elsewhere: inside backward, which the autograd engine runs on its own thread per CUDA
    device (measured on an H100: one all-reduce from that thread, as DDP's own hooks do)."""
    assert all(calls == [] for calls in result["from_python_threads"].values()), result
    off_main = result["off_main_thread"]
    assert all(calls == [] for section, calls in off_main.items() if section != "ddp"), off_main


@TWO_GPUS
def test_every_collective_over_two_nccl_ranks_matches_gloo_on_the_cpu():
    on_nccl = run_ranks(every_collective, 2, backend="nccl")
    on_cpu = run_ranks(every_collective, 2)
    for nccl, cpu in zip(on_nccl, on_cpu, strict=True):
        assert "batch_isend_irecv" in nccl["calls"]
        assert_nccl_threads(nccl)
        assert_results_close(nccl, cpu)


@TWO_GPUS
def test_compressed_allreduce_over_two_nccl_ranks_matches_gloo_on_the_cpu():
    on_cpu = run_ranks(compressed_calls, 2, 5000, 5, 1024)
    on_nccl = run_ranks(compressed_calls, 2, 5000, 5, 1024, backend="nccl")
    for cpu, nccl in zip(on_cpu, on_nccl, strict=True):
        assert nccl["bytes"] == cpu["bytes"]
        for got, want in zip(nccl["outs"], cpu["outs"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(
        torch.equal(a, b) for a, b in zip(on_nccl[0]["outs"], on_nccl[1]["outs"], strict=True)
    )


@TWO_GPUS
def test_onebit_lamb_over_two_nccl_ranks_matches_gloo_on_the_cpu():
    on_cpu = run_ranks(run_onebit_lamb, 2, 8, 2, None)
    on_nccl = run_ranks(run_onebit_lamb, 2, 8, 2, None, backend="nccl")
    for cpu, nccl in zip(on_cpu, on_nccl, strict=True):
        assert nccl["stages"] == cpu["stages"] == ["warmup"] * 3 + ["compression"] * 5
        assert nccl["bytes"] == cpu["bytes"]
        for got, want in zip(nccl["params"], cpu["params"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- device clock


def test_training_step_seconds_come_from_cuda_events(tiny_corpus, tmp_path):
    from onebit_bert.config import from_dict
    from onebit_bert.distributed import init_distributed
    from onebit_bert.timing import CUDA_EVENTS, PENDING
    from pretrain.config import PretrainConfig
    from pretrain.train import Trainer

    cfg = tiny_config(tiny_corpus, tmp_path / "run", **{"schedule.max_steps": 3})
    trainer = Trainer(from_dict(PretrainConfig, cfg), init_distributed(env={}))
    try:
        records = [trainer.step_metrics(trainer.train_step(step)) for step in (1, 2, 3)]
    finally:
        trainer.logger.close()
        trainer.release()
    assert len(PENDING) == 0  # every collective's events were resolved with its step
    for metrics in records:
        assert metrics["clock"] == CUDA_EVENTS
        phases = ("forward_backward_seconds", "grad_sync_seconds", "optimizer_seconds")
        assert all(metrics[k] >= 0 for k in phases)
        assert sum(metrics[k] for k in phases) == pytest.approx(metrics["step_seconds"])
        assert 0 < metrics["step_seconds"] < 60


# ----------------------------------------------------------------------------- compiled, profiled
# Last in the file: a prepared GPU check whose time runs out loses these, not the others.


def test_the_step_profile_counts_the_fused_optimizer_kernels_as_the_optimizer():
    """bench/step_profile.py on real CUDA events: the fused LAMB kernels (launched by
    Triton, outside any aten op) fall under the optimizer, the matrix products under gemm,
    and no kernel of the forward or backward pass under the optimizer."""
    from torch.profiler import ProfilerActivity, profile

    from bench.step_profile import device_work, profile_steps

    model = PretrainingLoss(build_model(ModelConfig(preset="bert-tiny"), 1000)).to(GPU)
    opt = Lamb(model.parameters(), lr=1e-3, kernels="fused")
    ids = torch.randint(5, 1000, (8, 64), device=GPU)
    batch = {
        "input_ids": ids,
        "token_type_ids": torch.zeros_like(ids),
        "attention_mask": torch.ones_like(ids),
        "mlm_labels": ids,
        "nsp_labels": torch.zeros(8, dtype=torch.long, device=GPU),
    }

    def step(_):
        loss, _stats = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(0)  # Triton compiles its kernels here
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(1)
        torch.cuda.synchronize()
    work = device_work(prof.events())
    fused = [(name, category) for name, category, _ in work if "lamb_measure" in name
             or "scaled_step" in name]  # fmt: skip
    assert fused and all(category == "optimizer" for _, category in fused), fused
    gemm = [name for name, category, _ in work if category == "gemm"]
    assert gemm, sorted({name for name, _, _ in work})
    optimizer = {name for name, category, _ in work if category == "optimizer"}
    assert not any("gemm" in name or "xmma" in name or "nvjet" in name for name in optimizer)
    summary = profile_steps(step, 2, cuda=True)
    assert summary["source"] == "cuda kernels"
    assert summary["categories"]["gemm"] > 0 and summary["categories"]["optimizer"] > 0


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_compiled_model_on_cuda_trains_like_the_eager_one(tiny_corpus, tmp_path, mode):
    """model.compile on CUDA (Inductor's Triton kernels; reduce-overhead also CUDA graphs),
    bf16, no dropout: 6 steps follow the eager run on the same GPU."""
    common = {"model.dropout": 0.0, "schedule.max_steps": 6, "precision": "bf16"}
    run_ranks(train_in_process, 1, tiny_config(tiny_corpus, tmp_path / "eager", **common),
              device=GPU)  # fmt: skip
    compiled = tiny_config(tiny_corpus, tmp_path / "compiled", **common, **{"model.compile": mode})
    summary = run_ranks(train_in_process, 1, compiled, device=GPU)[0]["summary"]
    assert summary["state"] == "complete"
    eager, losses = mlm_losses(tmp_path / "eager"), mlm_losses(tmp_path / "compiled")
    assert len(losses) == 6
    np.testing.assert_allclose(losses, eager, rtol=0.02)
