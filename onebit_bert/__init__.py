"""The core library: collectives and 1-bit compression (``distributed``), optimizers
(``optim``), sync strategies (``strategies``), shards, checkpoints, precision, metrics
logging, atomic io and typed configs. The stages (``data_prep``, ``pretrain``,
``finetune``) import only this package; the orchestrator (``pipeline``) imports the stages.
"""
