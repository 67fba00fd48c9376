"""Distributed machinery shared by every stage: process-group setup and all collectives."""

from onebit_bert.distributed.codecs.compression import ErrorFeedback
from onebit_bert.distributed.comm import TRAFFIC_KINDS, AsyncAllReduce, CommStats, Communicator
from onebit_bert.distributed.env import (
    DistContext,
    LaunchEnv,
    destroy_distributed,
    init_distributed,
    resolve_launch_env,
)

__all__ = [
    "TRAFFIC_KINDS",
    "AsyncAllReduce",
    "CommStats",
    "Communicator",
    "DistContext",
    "ErrorFeedback",
    "LaunchEnv",
    "destroy_distributed",
    "init_distributed",
    "resolve_launch_env",
]
