#!/usr/bin/env python3
"""Replays the shared allocation sequences against a caching allocator and prints their bytes.

The sequences are tests/caching_allocator/sequences.json; the allocator the CPU meter's emulation
of CUDA's (``--device cpu``) or a GPU's real one
(``--device cuda``), and prints each case's bytes next to the table's (the emulation's policy
worked by hand): allocated, reserved and peak reserved bytes, and the allocations that ran out of
memory. ``--json`` writes them. Exit code 0 when every case ran (whether or not it matched: the
comparison is the reader's, or the test's), 2 for a bad argument.

    PYTHONPATH=build/python python tools/replay_allocation_sequences.py --device cpu
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any, Callable, Dict, List

import torch

TABLE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "caching_allocator" / "sequences.json"


class CpuReplay:
    """The CPU meter playing the caching allocator (installed first: nothing else is in it)."""

    def __init__(self) -> None:
        import xpm
        self.meter = xpm.CpuMeter.install(caching=True, expandable_segments=False)
        self.device = torch.device("cpu")

    def start(self, case: Dict[str, Any]) -> None:
        self.meter.set_caching(True, expandable_segments=case["expandable_segments"])
        self.meter.capacity_bytes = case["capacity_bytes"]
        self.meter.empty_cache()
        self.meter.reset_peak()

    def stats(self) -> Dict[str, int]:
        return {"allocated_bytes": self.meter.current_allocated_bytes,
                "reserved_bytes": self.meter.current_reserved_bytes,
                "peak_reserved_bytes": self.meter.peak_reserved_bytes}

    def finish(self) -> None:
        self.meter.capacity_bytes = 0
        self.meter.empty_cache()


class CudaReplay:
    """The GPU's caching allocator (``torch.cuda``), settings switched per case."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            print("replay_allocation_sequences.py: error: --device cuda but torch sees no GPU", file=sys.stderr)
            raise SystemExit(2)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.total_bytes = torch.cuda.get_device_properties(self.device).total_memory

    def start(self, case: Dict[str, Any]) -> None:
        torch.cuda.empty_cache()
        expandable = "True" if case["expandable_segments"] else "False"
        torch.cuda.memory._set_allocator_settings(f"expandable_segments:{expandable}")
        cap = case["capacity_bytes"]
        torch.cuda.set_per_process_memory_fraction(cap / self.total_bytes if cap else 1.0, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def stats(self) -> Dict[str, int]:
        return {"allocated_bytes": torch.cuda.memory_allocated(self.device),
                "reserved_bytes": torch.cuda.memory_reserved(self.device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device)}

    def finish(self) -> None:
        torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        torch.cuda.empty_cache()


def replay(case: Dict[str, Any], player: Any) -> Dict[str, Any]:
    """One case's events through ``player``; its bytes after the last event."""
    player.start(case)
    live: Dict[str, torch.Tensor] = {}
    out_of_memory: List[str] = []
    for event in case["events"]:
        if event[0] == "a":
            try:
                live[event[1]] = torch.empty(event[2], dtype=torch.uint8, device=player.device)
            except torch.OutOfMemoryError:
                out_of_memory.append(event[1])
        elif event[0] == "f":
            del live[event[1]]
        else:
            (torch.cuda.empty_cache if player.device.type == "cuda" else player.meter.empty_cache)()
    result = {"name": case["name"], **player.stats(), "out_of_memory": out_of_memory}
    live.clear()
    player.finish()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", help="writes the results here")
    args = parser.parse_args()
    if args.json and not pathlib.Path(args.json).resolve().parent.is_dir():
        parser.error(f"--json {args.json}: its folder does not exist")
    if args.json and pathlib.Path(args.json).is_dir():
        parser.error(f"--json {args.json}: is a folder; give a file path")
    table = json.loads(TABLE.read_text())
    make: Callable[[], Any] = CpuReplay if args.device == "cpu" else CudaReplay
    player = make()
    results = []
    for case in table["cases"]:
        result = replay(case, player)
        result["expected"] = case["expected"]
        results.append(result)
        keys = ("allocated_bytes", "reserved_bytes", "peak_reserved_bytes", "out_of_memory")
        shown = "; ".join(f"{k} {result[k]} (table {case['expected'][k]})" for k in keys)
        print(f"{case['name']} [{args.device}]: {shown}")
    if args.json:
        path = pathlib.Path(args.json)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps({"device": args.device, "torch": torch.__version__, "cases": results}, indent=1))
        temporary.replace(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
