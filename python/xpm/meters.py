"""The meters: peak allocated bytes of one device, with the capacity the steps run under.

    meter = xpm.CpuMeter.install()          # CPU: before the model is built (it counts its weights)
    meter.capacity_bytes = 2_000_000_000    # the cap; an allocation past it raises out of memory
    meter = xpm.CudaMeter("cuda:0")         # a GPU: torch.cuda's statistics
    meter.set_memory_fraction(0.5)          # the process capped at half the device

``Meter`` is the interface ``probe``, the sampler and the integrations read (the C++
``MemoryMeter``'s); ``DeviceKind`` names the devices ``probe(device=...)`` takes. ``METERS`` is
the registry ``probe(device=...)`` looks a device type up in: a meter for another device is a
class in a file of its own (the ``Meter`` members, a ``device`` attribute and a ``for_probe``
classmethod like these) and one entry there.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, Literal, Optional, Protocol, Union, runtime_checkable

import numpy as np
import torch


_installed_cpu_meter: Optional["CpuMeter"] = None


class CpuMeter:
    """Peak allocated bytes of CPU tensors (c10's CPU allocator, wrapped), with a hard cap
    that raises PyTorch's out-of-memory error. One per process; ``install()`` it before the
    model is built (a second ``install()`` returns the same meter).

    Args:
        native: the extension's meter; use ``CpuMeter.install()``.
    """

    device = torch.device("cpu")

    def __init__(self, native: Any) -> None:
        self._native = native

    @classmethod
    def install(cls) -> "CpuMeter":
        """Installs the meter into c10's CPU allocator (once per process), or returns it.

        Returns:
            The process's CPU meter (no cap until ``capacity_bytes`` is set).

        Raises:
            ImportError: the running torch is not the one xpm was built against (one line naming
                both versions), or the extension cannot be loaded.
        """
        from .torch_extension import load_torch_extension  # the torch xpm was built against

        global _installed_cpu_meter
        _installed_cpu_meter = cls(load_torch_extension().CpuMemoryMeter.install())
        return _installed_cpu_meter

    @classmethod
    def installed(cls) -> Optional["CpuMeter"]:
        """The meter ``install()`` installed in this process, without installing one.

        Returns:
            The process's CPU meter, or None when ``install()`` was never called (the weights
            built so far were then not counted, so a meter installed now could not probe them).
        """
        return _installed_cpu_meter

    @property
    def capacity_bytes(self) -> int:
        """Cap on allocated bytes (0: none); an allocation past it raises out of memory."""
        return self._native.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or \
                not math.isfinite(value) or value < 0 or value != int(value):
            raise ValueError(f"CpuMeter.capacity_bytes must be a whole number of bytes >= 0 (0: no cap), got {value!r}")
        self._native.capacity_bytes = int(value)

    @property
    def current_allocated_bytes(self) -> int:
        """Bytes of CPU tensors allocated now (since the meter was installed)."""
        return self._native.current_allocated_bytes

    @property
    def peak_allocated_bytes(self) -> int:
        """Peak allocated bytes since the last ``reset_peak()``."""
        return self._native.peak_allocated_bytes

    @property
    def oom_count(self) -> int:
        """Allocations the cap refused since the process started (each raised an out-of-memory
        error)."""
        return self._native.oom_count

    def reset_peak(self) -> None:
        """Starts a new peak at the bytes allocated now."""
        self._native.reset_peak()


    @classmethod
    def for_probe(cls, device: Union[torch.device, str], meter: Optional[Any], where: str, shown: str) -> "CpuMeter":
        """``meter``, checked for ``probe(device=...)`` on the CPU: it must be the installed
        ``CpuMeter`` (probe cannot make one: it must count the weights as they are allocated).

        Args:
            device: what ``probe`` was given, of type "cpu".
            meter: what ``probe`` was given as ``meter``.
            where, shown: the errors' start and how they name the argument (``"device='cpu'"``).

        Returns:
            ``meter``.

        Raises:
            ValueError: one line: ``meter`` is None or not a ``CpuMeter``.
        """
        if meter is None:
            raise ValueError(f"{where}: {shown} needs meter=, a CpuMeter that probe cannot make: it must count the "
                             f"weights as they are allocated, so call xpm.CpuMeter.install() before building the "
                             f"model and pass it as meter=")
        if not isinstance(meter, CpuMeter):
            raise ValueError(f"{where}: {shown} but meter is {_shown_meter(meter)}: give the xpm.CpuMeter installed "
                             f"before the model was built")
        return meter


def _shown_meter(meter: Any) -> str:
    """``meter`` in a few words: its class, and a CudaMeter's device."""
    return f"a CudaMeter of {meter.device}" if isinstance(meter, CudaMeter) else f"a {type(meter).__name__}"


def _no_cuda_reason() -> str:
    """Why ``torch.cuda.is_available()`` is False, in a few words, for one-line errors."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__} is a build without CUDA"
    built = f"CUDA {torch.version.cuda}" if torch.version.cuda is not None else f"ROCm {torch.version.hip}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"torch {torch.__version__} is built with {built} but sees no GPU" +
            (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""))


def _cuda_device(device: Union[torch.device, str, int, None], where: str, shown: str, on_cpu: str) -> torch.device:
    """``device`` as ``torch.device("cuda", index)`` of a GPU this process sees (None: the
    current one); otherwise a one-line ValueError that starts with ``where``, names the argument
    as ``shown`` (``"device='cuda:1'"``, or "" when there is none) and, when torch sees no GPU,
    ends with ``on_cpu``, what to do instead. Nothing is allocated on a GPU."""
    given = f"{shown} but " if shown else ""
    if not torch.cuda.is_available():
        raise ValueError(f"{where}: {given}torch.cuda.is_available() is False ({_no_cuda_reason()}); {on_cpu}")
    try:
        parsed = torch.device("cuda") if device is None else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{where}: {shown} is not a device: give 'cuda', 'cuda:N' or a torch.device") from None
    if parsed.type != "cuda":
        raise ValueError(f"{where}: {shown} is not a CUDA device: give 'cuda', 'cuda:N' or a torch.device of type "
                         f"'cuda' (for CPU tensors use xpm.CpuMeter.install())")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if parsed.index is None else parsed.index
    if not 0 <= index < count:
        raise ValueError(f"{where}: {given}torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


class CudaMeter:
    """Peak allocated bytes of one CUDA device through ``torch.cuda`` (reset per probe phase);
    the capacity is the device's total memory, or the share of it ``set_memory_fraction`` caps
    the process at.

    Args:
        device: the GPU, ``torch.device("cuda", N)``, ``"cuda:N"`` or N; default (None or
            ``"cuda"``) the current one.

    Attributes:
        device: the GPU measured, ``torch.device("cuda", index)`` (index always set).
        memory_fraction: the share of the device's memory the process may use (1.0 unless
            ``set_memory_fraction`` set it).

    Raises:
        ValueError: one line, before anything is done on a GPU: torch sees no CUDA device
            (``torch.cuda.is_available()`` is False, with the reason: a build without CUDA, or no
            GPU visible), ``device`` is not a CUDA device, or its index is not one torch sees.
    """

    def __init__(self, device: Union[torch.device, str, int, None] = None) -> None:
        shown = "" if device is None else f"device='{device}'"
        on_cpu = "on CPU use xpm.CpuMeter.install(), installed before the model is built"
        self.device: torch.device = _cuda_device(device, "CudaMeter", shown, on_cpu)
        self.memory_fraction = 1.0

    @classmethod
    def for_probe(cls, device: Union[torch.device, str], meter: Optional[Any], where: str, shown: str) -> "CudaMeter":
        """The meter of ``probe(device=...)`` on a GPU: ``meter`` checked against the device, or a
        ``CudaMeter`` of it when ``meter`` is None.

        Args:
            device: what ``probe`` was given, of type "cuda".
            meter: what ``probe`` was given as ``meter`` (None: one is made).
            where, shown: the errors' start and how they name the argument (``"device='cuda'"``).

        Returns:
            ``meter``, or a new ``CudaMeter`` of the device.

        Raises:
            ValueError: one line: no GPU torch sees at ``device``, ``meter`` not a ``CudaMeter``, or
                one of another device.
        """
        target = _cuda_device(device, where, shown, "on CPU use device='cpu' with meter=xpm.CpuMeter.install(), "
                                                    "installed before the model is built")
        if meter is not None and not isinstance(meter, CudaMeter):
            raise ValueError(f"{where}: {shown} but meter is {_shown_meter(meter)}: give meter=xpm.CudaMeter"
                             f"(torch.device('{target}')) or meter=None")
        if meter is not None and meter.device != target:
            resolved = "" if str(device) == str(target) else f" ({target})"
            raise ValueError(f"{where}: {shown}{resolved} but meter is {_shown_meter(meter)}: give "
                             f"meter=xpm.CudaMeter(torch.device('{target}')) or meter=None")
        return CudaMeter(target) if meter is None else meter

    @property
    def capacity_bytes(self) -> int:
        """The device's total memory times ``memory_fraction``, bytes."""
        return int(torch.cuda.get_device_properties(self.device).total_memory * self.memory_fraction)

    def set_memory_fraction(self, fraction: float) -> None:
        """Caps the process's allocations on the device at ``fraction`` of its memory
        (``torch.cuda.set_per_process_memory_fraction``: beyond it the caching allocator raises
        ``torch.OutOfMemoryError``); ``capacity_bytes`` follows. Set it here rather than through
        torch, so that the probes' out-of-memory bounds name the capacity they ran under.

        Args:
            fraction: in (0, 1].

        Raises:
            ValueError: ``fraction`` is not in (0, 1].
        """
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"CudaMeter.set_memory_fraction: fraction must be in (0, 1], got {fraction!r}")
        torch.cuda.set_per_process_memory_fraction(float(fraction), self.device)
        self.memory_fraction = float(fraction)

    @property
    def current_allocated_bytes(self) -> int:
        """Bytes of tensors allocated on the device now (``torch.cuda.memory_allocated``)."""
        return torch.cuda.memory_allocated(self.device)

    @property
    def peak_allocated_bytes(self) -> int:
        """Peak allocated bytes since the last ``reset_peak()`` (``torch.cuda.max_memory_allocated``)."""
        return torch.cuda.max_memory_allocated(self.device)

    @property
    def peak_reserved_bytes(self) -> int:
        """The caching allocator's reserved peak since the last ``reset_peak()``, bytes (for reports)."""
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        """Waits for the device's work, then starts new peaks (``torch.cuda.reset_peak_memory_stats``)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


@runtime_checkable
class Meter(Protocol):
    """What ``probe``, the sampler's calibration and the integrations read of a meter (the C++
    ``MemoryMeter``'s interface): ``CpuMeter.install()`` or ``CudaMeter(...)``, or a meter of
    your own for another device with these members."""

    @property
    def capacity_bytes(self) -> int:
        """The cap allocations run under, bytes (0: none)."""

    @property
    def current_allocated_bytes(self) -> int:
        """Bytes allocated now."""

    @property
    def peak_allocated_bytes(self) -> int:
        """Peak allocated bytes since the last ``reset_peak()``."""

    def reset_peak(self) -> None:
        """Starts a new peak at the bytes allocated now."""

DeviceKind = Literal["cpu", "cuda"]
"""The kinds of device ``probe(device=...)`` names (with ``"cuda:N"`` and ``torch.device``)."""

METERS: Dict[str, Any] = {"cpu": CpuMeter, "cuda": CudaMeter}
"""The meter class of each device type (``torch.device(...).type``) ``probe(device=...)`` takes."""
