"""Probing on every rank in lockstep, for models whose forward and backward are collectives
(FSDP2's ``fully_shard``: each layer's parameters are all-gathered in forward and backward, its
gradients reduce-scattered), where a probe cannot run on rank 0 alone.

``xpm.probe(..., lockstep=True)`` runs on every rank of the process group: the same probe
shapes in the same order (the design is computed from the probes' results, which every rank
shares), so the collectives inside forward and backward match. After each probe one all-reduce
(max) combines the ranks: each phase's peak is the largest over ranks, a probe that ran out of
memory on any rank is out of memory for all, and an error on any rank stops every rank, naming
the rank. Every rank fits the same probes and returns the same model.

What lockstep cannot prevent: a rank that fails in the middle of a forward leaves the others
waiting in that forward's collective until the process group's timeout
(``torch.distributed.init_process_group(timeout=...)``). Under a symmetric memory cap the ranks
run out of memory at the same allocation, so this is rare; keep the timeout short while
probing.
"""
from __future__ import annotations

import contextlib
import zlib
from typing import Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist


class Lockstep:
    """The ranks of ``group`` combined by all-reduces (max), one per call.

    Args:
        group: the process group (None: the default one).

    Raises:
        ValueError: torch.distributed is not initialised.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("probe: lockstep=True probes on every rank of a process group, but torch.distributed is "
                             "not initialised: call torch.distributed.init_process_group first (torchrun sets its "
                             "environment)")
        self.group = group
        self.rank: int = dist.get_rank(group)
        self.world_size: int = dist.get_world_size(group)
        backend = dist.get_backend(group)
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def max(self, values: Sequence[float]) -> List[float]:
        """Each value's maximum over the ranks (one all-reduce).

        Args:
            values: this rank's values, the same count on every rank.

        Returns:
            The maxima, in order.
        """
        tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.cpu().tolist()

    def flags(self, mine: bool) -> List[int]:
        """The ranks whose flag is set (one all-reduce).

        Args:
            mine: this rank's flag.

        Returns:
            The ranks, ascending.
        """
        values = [0.0] * self.world_size
        values[self.rank] = 1.0 if mine else 0.0
        return [r for r, flag in enumerate(self.max(values)) if flag > 0]

    def agree(self, error: Optional[BaseException], what: str) -> None:
        """Raises on every rank when ``error`` is set on some rank: this rank's own error, or a
        RuntimeError naming the ranks that failed (one all-reduce).

        Args:
            error: this rank's error, or None.
            what: what failed, for the other ranks' message ("probe: checking the options").

        Raises:
            BaseException: ``error`` on the rank that had it.
            RuntimeError: on the others, when some rank had one.
        """
        failed = self.flags(error is not None)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"{what} failed on rank {', '.join(map(str, failed))} (its own error says why); every "
                               f"rank stops")

    def same(self, fingerprint: str, what: str) -> None:
        """Raises ValueError on every rank unless every rank gave the same ``fingerprint`` (one
        all-reduce of its CRC-32, as a maximum and a minimum).

        Args:
            fingerprint: what must agree (the arguments, as text).
            what: what it describes, for the message ("probe: the formula and options").

        Raises:
            ValueError: on every rank, when the ranks' fingerprints differ.
        """
        crc = float(zlib.crc32(fingerprint.encode()))
        largest, negated_smallest = self.max([crc, -crc])
        if largest != -negated_smallest:
            raise ValueError(f"{what} differ between the ranks (this is rank {self.rank}): in lockstep every rank must "
                             f"give the same, or their probes' collectives would not match")


_FAILURE_KEY = "xpm/lockstep/failure"


@contextlib.contextmanager
def stop_together() -> Iterator[None]:
    """Every rank stops with the same message when one rank's step fails.

    Inside the block (a training step of an FSDP2 model), an exception on one rank is posted to
    the default process group's store before it propagates; that rank's process then ends, and
    the other ranks' collectives fail ("Connection closed by peer"). Their error is replaced by
    the posted one, so every rank reports the rank that failed first and why:
    ``RuntimeError: rank 1 failed: OutOfMemoryError: CPU memory cap exceeded: ...``.

        with xpm.stop_together():
            for indices, weight in zip(step.microbatches, step.weights):
                ...forward, backward...

    The failing rank must let the error end its process (a rank that catches it and goes on
    leaves the others waiting until the process group's timeout).

    Returns:
        A context manager around the step (it yields nothing).

    Raises:
        RuntimeError: on a rank whose collective failed because another rank failed first,
            naming that rank and its error (the first failure posted, whichever rank it was).
        BaseException: the first failure, unchanged, on the rank it happened on.
    """
    store = _default_store()
    try:
        yield
    except BaseException as error:  # noqa: BLE001 - posted, or replaced by the first failure, then raised
        if store is None:
            raise
        rank = dist.get_rank()
        line = (str(error).splitlines() or [""])[0]
        mine = f"rank {rank} failed: {type(error).__name__}: {line}"
        # The first to post wins (compare_set from the empty value); the others read it.
        first = store.compare_set(_FAILURE_KEY, "", mine).decode()
        if first == mine:
            raise
        raise RuntimeError(first) from error


def _default_store() -> Optional[dist.Store]:
    """The default process group's store, or None when there is none to post to."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
