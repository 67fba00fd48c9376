"""Distributed machinery shared by every stage: process-group setup and all collectives."""

from pipeline.distributed.comm import CommStats, Communicator
from pipeline.distributed.compression import ErrorFeedback
from pipeline.distributed.env import (
    DistContext,
    LaunchEnv,
    destroy_distributed,
    init_distributed,
    resolve_launch_env,
)

__all__ = [
    "CommStats",
    "Communicator",
    "DistContext",
    "ErrorFeedback",
    "LaunchEnv",
    "destroy_distributed",
    "init_distributed",
    "resolve_launch_env",
]
