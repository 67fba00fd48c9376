"""Record every collective a process issues through ``torch.distributed``: which function,
on which process group, from which thread, in order.

    with CollectiveTrace() as trace:
        ...                      # code under test
    trace.calls                  # [(function, group name), ...]
    trace.off_main_thread        # the calls issued from any other thread
    trace.from_python_threads    # those of them from threads Python started (threading)

The group is named by its ``group_name`` (assigned in creation order, the same on every
rank when every rank creates its groups in the same order). Only Python-level calls are
seen; collectives that C++ code issues by itself (DDP's reducer) are not.

A thread Python did not start (``threading`` names it ``Dummy-N``) is torch's own: on CUDA
the autograd engine runs backward on a thread per device, so DDP's communication hooks,
torch's own and ours alike, issue their all-reduces there; gloo completes futures, and
runs their callbacks, on its own thread."""

from __future__ import annotations

import functools
import threading

import torch.distributed as dist

TRACED = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_to_all",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "batch_isend_irecv",
    "barrier",
    "send",
    "recv",
)
"""isend and irecv stay unwrapped: ``P2POp`` checks them by identity (its list goes through
``batch_isend_irecv``, which is traced)."""


def _group_name(group) -> str:
    if group is None:
        group = dist.group.WORLD
    return getattr(group, "group_name", None) or str(dist.get_process_group_ranks(group))


class CollectiveTrace:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.off_main_thread: list[tuple[str, str, str]] = []
        self.from_python_threads: list[tuple[str, str, str]] = []
        self._saved: dict[str, object] = {}

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if name == "batch_isend_irecv":
                ops = args[0] if args else kwargs["p2p_op_list"]
                group = ops[0].group if ops else None
            else:
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            entry = (name, _group_name(group))
            self.calls.append(entry)
            thread = threading.current_thread()
            if thread is not threading.main_thread():
                self.off_main_thread.append((*entry, thread.name))
                if not isinstance(thread, threading._DummyThread):
                    self.from_python_threads.append((*entry, thread.name))
            return fn(*args, **kwargs)

        return traced

    def __enter__(self) -> CollectiveTrace:
        for name in TRACED:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
