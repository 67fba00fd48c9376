"""Helpers shared by more than one test module: tiny pretraining configs and launches
(:mod:`tests.helpers.runs`), the simulated compressed all-reduce and the optimizers' toy
problem (:mod:`tests.helpers.compression`), checkpoint comparison
(:mod:`tests.helpers.checkpoints`), host-sync counts (:mod:`tests.helpers.syncs`) and loss
scaling across ranks (:mod:`tests.helpers.loss_scaling`). Test modules import from here and
never from one another (tests/test_layering.py checks it).
"""
