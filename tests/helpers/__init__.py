"""Helpers shared by more than one test module. Test modules import from here and never
from one another (tests/test_layering.py checks it).

- :mod:`~tests.helpers.paths`: the repository root and the shared real-data folder;
- :mod:`~tests.helpers.corpus`: the generated test corpus, written and prepared;
- :mod:`~tests.helpers.distributed_harness`: ``run_ranks``, a function on N gloo ranks;
- :mod:`~tests.helpers.runs`: tiny pretraining configs and launches;
- :mod:`~tests.helpers.toy`: the strategies' toy regression problem;
- :mod:`~tests.helpers.compression`: the simulated compressed all-reduce and the
  optimizers' toy problem;
- :mod:`~tests.helpers.checkpoints`, :mod:`~tests.helpers.syncs`,
  :mod:`~tests.helpers.loss_scaling`: checkpoint comparison, host-sync counts, loss
  scaling across ranks;
- :mod:`~tests.helpers.golden`: the golden trajectories (data in tests/golden/);
- :mod:`~tests.helpers.slurm_cluster`: a local two-node SLURM cluster;
- :mod:`~tests.helpers.tiny_bert`, :mod:`~tests.helpers.collective_trace`,
  :mod:`~tests.helpers.kernel_checks`, :mod:`~tests.helpers.nccl`: the users'-script
  recipes' model, the collective trace, the fused kernels' checks, the NCCL checks.
"""
