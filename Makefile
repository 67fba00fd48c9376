# Everything runs from the project's own virtual environment, built on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RANKS ?= 4
NUMEL ?= 25000000
# Corpora for data preparation; the shared sample folder by default.
DATA_ROOT ?= ../shared/data
DATA_OUT ?=
ARGS ?=

.PHONY: setup test test-slow test-all test-gpu lint format config-docs smoke repro-mini parity compare tune submit data data-sample pretrain finetune report bench-comm bench-data bench-train bench-gpu gpu-check bench-netem bench-giant-doc clean

setup: $(STAMP)

# torch first and exactly pinned, with pip (which finds a local wheel where the machine has
# one): an unpinned resolve could pull a multi-GB build. The rest with uv, pinned by
# constraints.txt; the installed torch satisfies the project's range, so uv leaves it. uv
# is several times faster than pip here; pip takes over if uv cannot be had. Bytecode is
# compiled once, for all of site-packages, on every core: where PYTHONDONTWRITEBYTECODE is
# set, a venv without it recompiles torch and transformers in every process. EXTRAS:
# the optional dependencies; gpu brings Triton, whose interpreter runs the fused kernels'
# tests on the CPU (without it make test skips them). EXTRAS=dev leaves it out.
EXTRAS ?= dev,gpu
PIP := $(PY) -m pip install --quiet --disable-pip-version-check --no-compile
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	( $(PIP) -c constraints.txt uv && $(VENV)/bin/uv pip install --quiet --python $(PY) \
	    -c constraints.txt -e '.[$(EXTRAS)]' ) || $(PIP) -c constraints.txt -e '.[$(EXTRAS)]'
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	  > /dev/null || true  # a few files are for newer Pythons
	touch $(STAMP)

# Tests in two tiers. make test: every test but the slow and CUDA ones, the quick check
# after a change (the README's command). make test-slow: the slow tier (a real 2-node
# SLURM cluster, the emulated slow network, long multi-process runs; installs SLURM with
# apt when root). make test-all: both, what CI runs. Durations: docs/guide/development.md.
# The fast tier runs on TEST_WORKERS pytest-xdist workers (auto: one per core), handing
# out single tests as workers free up; the slow tier stays serial (one SLURM cluster, one
# emulated network). TEST_WORKERS=0 runs the fast tier in this process.
TEST_WORKERS ?= auto
test: setup
	$(PY) -m pytest -m "not slow and not cuda" -n $(TEST_WORKERS) --dist worksteal $(ARGS)

test-slow: setup
	$(PY) -m pytest -m "slow and not cuda" $(ARGS)

test-all: test test-slow

# Only the CUDA tests (marker cuda: GPU results against the CPU's); without a GPU this fails
# at once instead of passing with every test skipped (make test skips them there).
NO_CUDA_TESTS := test-gpu needs a CUDA GPU; none found (torch.cuda.is_available() is False)
test-gpu: setup
	@$(PY) -c "import sys, torch; torch.cuda.is_available() or sys.exit('$(NO_CUDA_TESTS)')"
	$(PY) -m pytest -v -m cuda $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# docs/guide/configuration.md from the config dataclasses (a test checks it is current).
config-docs: setup
	$(PY) -m pipeline.config_reference

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The whole chain, tiny, on CPU: generated corpus -> data_prep -> bert-tiny with LAMB and
# 1-bit LAMB (2 gloo workers) -> fine-tuning on generated GLUE/SQuAD-format tasks -> report.
smoke: setup
	$(PY) -m pipeline run --config configs/experiments/smoke.yaml $(ARGS)

# The small real-data reproduction: 3 pretraining seeds x (LAMB, 1-bit LAMB), fine-tuned and
# compared (wall time measured: docs/results/2026-11-23-repro-mini.md; not part of make test).
repro-mini: setup
	$(PY) -m pipeline run --config configs/experiments/repro_mini.yaml \
		"data.overrides=[data_root=$(abspath $(DATA_ROOT))]" \
		"finetune.overrides=[data_root=$(abspath $(DATA_ROOT)), squad_eval_fraction=0.2]" $(ARGS)

# Parity: LAMB vs 1-bit LAMB in the scale-matched regime, 5 pretraining seeds per arm, a
# target fixed from LAMB before 1-bit LAMB runs, the gate on samples to target, fine-tuning
# against a randomly initialised baseline, freeze-step sensitivity (docs/guide/parity.md).
# Hours on 2 cores; every stage resumes, so run the same command again after any stop.
# ARGS: e.g. workdir=/scratch/parity, or --stages pretrain/lamb-seed1 target.
# PARITY=configs/experiments/parity_long.yaml runs the regime stretched to 6,000 steps.
PARITY ?= configs/experiments/parity.yaml
parity: setup
	$(PY) -m pipeline run --config $(PARITY) \
		"data.overrides=[data_root=$(abspath $(DATA_ROOT))]" \
		"finetune.overrides=[data_root=$(abspath $(DATA_ROOT))]" $(ARGS)

# The comparison: every strategy pretrained in the learning regime on 4 workers (LAMB x3
# seeds, 1-bit LAMB x2, the others x1), fine-tuned, and the comparison report with
# time-to-accuracy from docs/results/compare/netem.json (docs/results/2026-11-25-comparison.md); resumable.
# QUICK=1: the same chain with short runs and two tasks, to try it out.
COMPARE_CONFIG = configs/experiments/$(if $(QUICK),compare_quick,compare).yaml
compare: setup
	$(PY) -m pipeline run --config $(COMPARE_CONFIG) \
		"data.overrides=[data_root=$(abspath $(DATA_ROOT))]" \
		"finetune.overrides=[data_root=$(abspath $(DATA_ROOT))]" $(ARGS)

# Equal-budget tuning in the parity regime (python -m pipeline.tune): BUDGET trials per recipe
# by successive halving on seed 1 (rungs from 375 steps up to the run's 3,000), then the
# chosen setting on EVAL_SEEDS; resumable. It reads make parity's prepared data
# (runs/parity/data/seq64). NODES=2 runs each trial as 2 torchrun agents of 2 ranks here, for
# the recipes with nodes as workers (diloco_node, co2_node, slowmo_node, *_node).
# Results: docs/results/2026-11-26-tuned-comparison.md.
RECIPES ?= lamb,onebit_lamb
BUDGET ?= 3
NODES ?= 1
EVAL_SEEDS ?= 2,3
TUNE_DATA ?= runs/parity/data/seq64
TUNE_OUT ?= runs/tune
tune: setup
	$(PY) -m pipeline.tune --config configs/pretrain/parity.yaml --data $(TUNE_DATA) \
		--recipes $(RECIPES) --budget $(BUDGET) --first-rung 375 --nproc 4 --nodes $(NODES) \
		--eval-seeds $(EVAL_SEEDS) --out $(TUNE_OUT) $(ARGS)

# Submit an experiment to SLURM: make submit CONFIG=configs/experiments/bert_large.yaml
submit: setup
	$(PY) -m pipeline submit --config $(CONFIG) $(ARGS)

# The BERT corpus (Wikipedia + BookCorpus): from the hub, or with DATA_ROOT=<dir> from
# local files laid out as configs/data/bert_local.yaml describes. ARGS: key=value overrides.
data: setup
	@if [ "$(origin DATA_ROOT)" = "command line" ] || [ "$(origin DATA_ROOT)" = "environment" ]; then \
		$(PY) -m data_prep --config configs/data/bert_local.yaml data_root=$(DATA_ROOT) \
			$(if $(DATA_OUT),output=$(DATA_OUT)) $(ARGS); \
	else \
		$(PY) -m data_prep --config configs/data/bert.yaml $(if $(DATA_OUT),output=$(DATA_OUT)) $(ARGS); \
	fi

# The small local corpus: Wikipedia sample + Gutenberg books of DATA_ROOT (shared folder).
data-sample: setup
	$(PY) -m data_prep --config configs/data/sample.yaml data_root=$(DATA_ROOT) \
		$(if $(DATA_OUT),output=$(DATA_OUT)) $(ARGS)

# Compressed vs fp32 all-reduce on $(RANKS) gloo ranks, $(NUMEL) elements; JSON last line.
bench-comm: setup
	$(PY) -m bench.comm --world-size $(RANKS) --numel $(NUMEL)

# The fused kernels' GPU checks in about 8 minutes: the CUDA tests, then bench-gpu with the
# reference and fused kernels alternating (bf16, eager and compiled, lengths 128 and 512);
# JSON under $(OUT_GPU) (bench/gpu_check.sh). Uses the machine's Python where there is no
# .venv (a GPU machine's own CUDA build of torch).
OUT_GPU ?= runs/gpu_check
gpu-check:
	OUT=$(OUT_GPU) bash bench/gpu_check.sh

# data_prep vs the HF run_mlm-style pipeline on DATA_ROOT's Wikipedia sample; JSON last line.
bench-data: setup
	$(PY) -m bench.data --data-root $(DATA_ROOT)

# Our training loop vs HF Trainer (bert-mini, 1 process) and LAMB vs 1-bit LAMB step
# breakdown on 4 gloo ranks, on DATA_ROOT's Wikipedia sample; JSON last line.
bench-train: setup
	$(PY) -m bench.train --data-root $(DATA_ROOT)

# BERT-Large, seq 128, one GPU: our loop (LAMB, 1-bit LAMB, AdamW) vs HF Trainer, bf16 and
# fp16, eager and torch.compile: samples/s, peak memory, ratios; JSON last line. Needs CUDA.
# ARGS: e.g. --precisions bf16 --compile off --batch-size 32
bench-gpu: setup
	$(PY) -m bench.gpu $(ARGS)

# data_prep on one single-line document of MB megabytes (linear time, bounded memory); JSON.
MB ?= 50
bench-giant-doc: setup
	$(PY) -m bench.giant_document --mb $(MB)

# LAMB vs 1-bit LAMB on an emulated cluster (network namespaces + tc; needs root):
# 25, 40, 100 Mbit/s, 1 and 10 Gbit/s x 2 and 4 hosts, about 30 minutes on 2 cores.
# JSON and a plot in runs/bench_netem/. ARGS: e.g. --bandwidths 100 --world-sizes 2;
# --strategies lamb,co2 (any of lamb, onebit_lamb, adamw, onebit_adam, zero_one_adam, co2,
# slowmo, local_sgd, decentlam, dmsgd, hybrid_onebit_lamb, onebit_lamb_overlap, powersgd,
# lamb_node, onebit_lamb_node, hybrid_onebit_lamb_node), --outer-every N (local steps per
# round of co2, slowmo, local_sgd), --topologies ring,one_peer_exponential (graphs of
# decentlam and dmsgd), --ranks-per-host 2 (hosts of 2 ranks; the *_node strategies)
bench-netem: setup
	$(PY) -m bench.netem --data-root $(DATA_ROOT) $(ARGS)

# One pretraining phase on this machine: make pretrain CONFIG=configs/pretrain/tiny.yaml
# NPROC=2 ARGS="data.path=..."; on a cluster, use the SLURM templates.
CONFIG ?= configs/pretrain/tiny.yaml
NPROC ?= 1
pretrain: setup
	$(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) -m pretrain --config $(CONFIG) $(ARGS)

# make finetune CHECKPOINT=<hf model dir> TASKS=sst2,mrpc,squad DATA_ROOT=<dir> OUT=<dir>
# (ARGS: more field=value settings, e.g. "seeds=[1,2,3] squad_eval_fraction=0.2")
CHECKPOINT ?=
TASKS ?= sst2,mrpc
OUT ?= runs/finetune
finetune: setup
	@test -n "$(CHECKPOINT)" || { echo "set CHECKPOINT=<HF-format model directory>"; exit 2; }
	$(PY) -m finetune run checkpoint=$(CHECKPOINT) 'tasks=[$(TASKS)]' data_root=$(DATA_ROOT) \
		output=$(OUT) $(ARGS)

# make report RUNS="lamb=runs/pre_lamb:runs/ft_lamb onebit=runs/pre_onebit:runs/ft_onebit" REPORT=dir
RUNS ?=
REPORT ?= runs/report
report: setup
	$(PY) -m pipeline.reports.parity $(foreach r,$(RUNS),--run $(r)) --out $(REPORT)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
