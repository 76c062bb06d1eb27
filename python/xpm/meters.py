"""The meters: peak allocated and reserved bytes of one device, with the capacity the steps run
under.

    meter = xpm.CpuMeter.install()          # CPU: before the model is built (it counts its weights)
    meter.capacity_bytes = 2_000_000_000    # the cap; an allocation past it raises out of memory
    meter = xpm.CpuMeter.install(caching=True)  # ... playing CUDA's caching allocator: the cap
                                            # then bounds reserved bytes, as a GPU's memory does
    meter = xpm.CudaMeter("cuda:0")         # a GPU: torch.cuda's statistics
    meter.set_memory_fraction(0.5)          # the process capped at half the device

What a plan bounds (``planned_bytes_kind``): where a caching allocator holds segments (a GPU, or
the CPU meter with ``caching=True``) the reserved peak, which is what runs a GPU out of memory,
measured from an emptied cache (``start_peak``, ``planned_peak_bytes``); elsewhere the
allocated peak.

``Meter`` is the interface ``probe``, the sampler and the integrations read (the C++
``MemoryMeter``'s); ``DeviceKind`` names the devices ``probe(device=...)`` takes. ``METERS`` is
the registry ``probe(device=...)`` looks a device type up in: a meter for another device is a
class in a file of its own (the ``Meter`` members, a ``device`` attribute and a ``for_probe``
classmethod like these) and one entry there.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, Literal, Optional, Protocol, Union, runtime_checkable

import torch

from .record_dims import _finite_number


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
    def install(cls, caching: Optional[bool] = None, *, expandable_segments: Optional[bool] = None) -> "CpuMeter":
        """Installs the meter into c10's CPU allocator (once per process), or returns it.

        Args:
            caching: True: from now on the meter also plays CUDA's caching allocator over the
                storages it counts (its documented policy: 512-byte blocks, 2 and 20 MiB
                segments, best fit, split and merge, a cache released and retried before out of
                memory), so that ``capacity_bytes`` bounds reserved bytes and
                ``current_reserved_bytes`` / ``peak_reserved_bytes`` read them, as on a GPU;
                allocated bytes then count block sizes, as CUDA's do. False: stops it. None
                (default): as it is (off at the first install).
            expandable_segments: with ``caching=True``, PyTorch's ``expandable_segments:True``
                (one growing segment per pool); None: as it is where caching already runs, else
                as ``PYTORCH_ALLOC_CONF`` (or ``PYTORCH_CUDA_ALLOC_CONF``) says. Refused
                without ``caching=True``.

        Returns:
            The process's CPU meter (no cap until ``capacity_bytes`` is set): the same object at
            every call.

        Raises:
            ImportError: the running torch is not the one xpm was built against (one line naming
                both versions), or the extension cannot be loaded.
            ValueError: ``caching`` or ``expandable_segments`` is not a bool or None, or
                ``PYTORCH_ALLOC_CONF`` gives ``expandable_segments`` a value other than
                True/False.
            RuntimeError: expandable segments changed while blocks of the caching emulation
                are live.
        """
        from .torch_extension import load_torch_extension  # the torch xpm was built against

        for name, value in (("caching", caching), ("expandable_segments", expandable_segments)):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"CpuMeter.install: {name} must be True, False or None, got {value!r}")
        if expandable_segments is not None and caching is not True:
            raise ValueError(f"CpuMeter.install: expandable_segments={expandable_segments!r} needs caching=True")
        global _installed_cpu_meter
        native = load_torch_extension().CpuMemoryMeter.install()
        meter = _installed_cpu_meter if isinstance(_installed_cpu_meter, cls) else cls(native)
        if caching is not None:
            meter.set_caching(caching, expandable_segments=expandable_segments)
        _installed_cpu_meter = meter
        return meter

    def set_caching(self, enabled: bool, *, expandable_segments: Optional[bool] = None) -> None:
        """Starts or stops the caching allocator's emulation (see ``install``).

        Args:
            enabled: True starts it, False stops it (blocks it holds are still freed into it).
            expandable_segments: None: as it is where caching already runs, else as
                ``PYTORCH_ALLOC_CONF`` says (read only when ``enabled``).

        Raises:
            ValueError: ``enabled`` is not a bool, ``expandable_segments`` not a bool or None, or
                ``PYTORCH_ALLOC_CONF`` gives ``expandable_segments`` a value other than
                True/False.
            RuntimeError: expandable segments changed while blocks of the emulation are live.
        """
        for name, value in (("enabled", enabled), ("expandable_segments", expandable_segments)):
            if not isinstance(value, bool) and not (name == "expandable_segments" and value is None):
                raise ValueError(f"CpuMeter.set_caching: {name} must be True or False"
                                 f"{' (or None)' if name == 'expandable_segments' else ''}, got {value!r}")
        expandable = expandable_segments
        if expandable is None and enabled:  # as it is where caching runs, else as the environment says
            expandable = self.caching == "expandable_segments" if self.caching is not None else \
                allocator_settings().get("expandable_segments", "False") == "True"
        try:
            self._native.set_caching(enabled, bool(expandable))
        except RuntimeError as error:
            raise RuntimeError(f"CpuMeter.set_caching: {error}") from None

    @property
    def caching(self) -> Optional[Literal["segments", "expandable_segments"]]:
        """The caching allocator the meter plays: ``"segments"`` (PyTorch's default),
        ``"expandable_segments"``, or None (none: reserved bytes are the allocated ones)."""
        expandable = self._native.caching_expandable_segments
        return None if expandable is None else ("expandable_segments" if expandable else "segments")

    @property
    def reserves_segments(self) -> bool:
        """Whether a caching allocator (here its emulation) holds segments: plans then bound
        reserved bytes."""
        return self.caching is not None

    @property
    def current_reserved_bytes(self) -> int:
        """Bytes the emulated caching allocator holds (segments, cache included) plus storages
        outside it; the allocated bytes where caching never ran (after ``set_caching(False)``,
        the emulation's cache stays until ``empty_cache()``)."""
        return self._native.current_reserved_bytes

    @property
    def peak_reserved_bytes(self) -> int:
        """Peak reserved bytes since the last ``reset_peak()``."""
        return self._native.peak_reserved_bytes

    def empty_cache(self) -> None:
        """Releases the emulation's cached segments that hold no block in use
        (``torch.cuda.empty_cache()``'s counterpart; nothing where caching never ran)."""
        self._native.empty_cache()

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
        """Cap on allocated bytes, or on reserved bytes with caching (0: none); an allocation
        past it raises out of memory."""
        return self._native.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:
        if not _finite_number(value) or value < 0 or value != int(value) or value >= 2 ** 63:
            raise ValueError(f"CpuMeter.capacity_bytes must be a whole number of bytes >= 0 (0: no cap) and below "
                             f"2**63, got {value!r}")
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
    def current_reserved_bytes(self) -> int:
        """Bytes the caching allocator holds on the device now, cache included
        (``torch.cuda.memory_reserved``)."""
        return torch.cuda.memory_reserved(self.device)

    @property
    def peak_reserved_bytes(self) -> int:
        """The caching allocator's reserved peak since the last ``reset_peak()``, bytes: what
        plans on a GPU bound (``planned_peak_bytes``)."""
        return torch.cuda.max_memory_reserved(self.device)

    reserves_segments = True
    """A GPU's caching allocator holds segments: plans bound reserved bytes."""

    def empty_cache(self) -> None:
        """Releases the cached segments that hold no block in use (``torch.cuda.empty_cache``)."""
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()

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

PlannedBytes = Literal["allocated", "reserved"]
"""What a plan bounds: a step's peak allocated bytes, or its peak reserved bytes."""


def planned_bytes_kind(meter: Meter) -> PlannedBytes:
    """What plans measured by ``meter`` bound.

    Args:
        meter: any ``Meter``.

    Returns:
        ``"reserved"`` where a caching allocator holds segments (``CudaMeter``, a ``CpuMeter``
        with caching, any meter whose ``reserves_segments`` is true; it then has
        ``peak_reserved_bytes`` and ``empty_cache()``), else ``"allocated"``.
    """
    return "reserved" if getattr(meter, "reserves_segments", False) else "allocated"


def start_peak(meter: Meter) -> None:
    """Starts a measured peak: where plans bound reserved bytes, the cache is emptied first, so
    that the peak is what the step itself reserves (cached segments would be released before an
    out-of-memory error anyway); then ``meter.reset_peak()``.

    Args:
        meter: any ``Meter``.
    """
    if planned_bytes_kind(meter) == "reserved":
        meter.empty_cache()
    meter.reset_peak()


def planned_peak_bytes(meter: Meter) -> int:
    """The peak since ``start_peak`` that plans bound: reserved or allocated bytes
    (``planned_bytes_kind``).

    Args:
        meter: any ``Meter``.

    Returns:
        Bytes.

    Raises:
        TypeError: ``meter`` has no ``peak_allocated_bytes`` (None, or not a meter).
        ValueError: the peak it reads is not a number of bytes in [0, 2**63) (NaN, None, text),
            named with the attribute and the meter.
    """
    if not hasattr(meter, "peak_allocated_bytes"):
        raise TypeError(f"meter must be a meter (xpm.CpuMeter.install(), xpm.CudaMeter(...) or one with "
                        f"peak_allocated_bytes), got {meter!r}")
    attribute = "peak_reserved_bytes" if planned_bytes_kind(meter) == "reserved" else "peak_allocated_bytes"
    peak = getattr(meter, attribute)
    if not _finite_number(peak) or not 0 <= peak < 2 ** 63:
        raise ValueError(f"meter.{attribute} must be a number of bytes in [0, 2**63), got {peak!r:.40} from "
                         f"{_shown_meter(meter)}")
    return int(peak)


def allocator_settings(environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """PyTorch's caching-allocator settings: ``PYTORCH_ALLOC_CONF`` (or the older
    ``PYTORCH_CUDA_ALLOC_CONF`` when it is unset), ``key:value`` pairs separated by commas.

    Args:
        environ: the environment (default ``os.environ``).

    Returns:
        Each key's value, as written (``{"expandable_segments": "True"}``).

    Raises:
        ValueError: one line naming the variable: a pair without ``:``, or
            ``expandable_segments`` neither True nor False.
    """
    environ = os.environ if environ is None else environ
    name = "PYTORCH_ALLOC_CONF" if environ.get("PYTORCH_ALLOC_CONF") else "PYTORCH_CUDA_ALLOC_CONF"
    settings: Dict[str, str] = {}
    for pair in filter(None, (part.strip() for part in re.split(r",(?![^\[]*\])", environ.get(name, "")))):
        key, colon, value = pair.partition(":")
        if not colon:
            raise ValueError(f"{name}={environ[name]!r}: {pair!r} is not key:value")
        settings[key.strip()] = value.strip()
    if settings.get("expandable_segments", "False") not in ("True", "False"):
        raise ValueError(f"{name}={environ[name]!r}: expandable_segments must be True or False")
    return settings


def allocator_settings_line(environ: Optional[Dict[str, str]] = None) -> str:
    """One line on what the caching-allocator settings imply for planned microbatches.

    Args:
        environ: the environment (default ``os.environ``).

    Returns:
        The line (no trailing newline).

    Raises:
        ValueError: as ``allocator_settings``.
    """
    settings = allocator_settings(environ)
    others = ", ".join(f"{k}:{v}" for k, v in settings.items() if k != "expandable_segments")
    if settings.get("expandable_segments") == "True":
        line = ("allocator: expandable_segments:True: one growing segment per pool, so microbatches of changing "
                "shapes leave little reserved but unusable memory")
    else:
        line = ("allocator: fixed segments (PYTORCH_ALLOC_CONF without expandable_segments:True): microbatches of "
                "changing shapes fragment them and the plan reserves for that; expandable_segments:True usually "
                "lowers reserved bytes")
    return line + (f"; also set: {others}" if others else "")


DeviceKind = Literal["cpu", "cuda"]
"""The kinds of device ``probe(device=...)`` names (with ``"cuda:N"`` and ``torch.device``)."""

METERS: Dict[str, Any] = {"cpu": CpuMeter, "cuda": CudaMeter}
"""The meter class of each device type (``torch.device(...).type``) ``probe(device=...)`` takes."""
