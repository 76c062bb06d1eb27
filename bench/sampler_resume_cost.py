"""What setting a sampler's position costs per step: ``resume_at(epoch, steps_done)`` against
loading the sampler's own ``state_dict`` with those two fields changed (what the HF Trainer's
drop-in did after every step), on a sampler whose calibration and refit carry a window of
trained steps.

The sampler plans 1,003 records of 2 to 199 tokens in outer batches of 64 with a model whose
training peaks differ from the probes' by shape, so that the refit is taken and its window
fills; the two ways then alternate, ``--rounds`` times each ``--calls`` calls, and the script
prints the median milliseconds per call of each and their ratio.

    python bench/sampler_resume_cost.py --steps 12 --rounds 5 --calls 200
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, List

import numpy as np

import xpm

BUDGET = 6_000_000


def probed_model() -> xpm.MemoryModel:
    """The probes' model: 4 bytes per bs*l^2, 2,000 per bs*l and 1 MB, fitted on five shapes."""
    dims = np.array([[1, 8], [4, 64], [16, 128], [32, 16], [8, 200]], dtype=float)
    peaks = 4 * dims[:, 0] * dims[:, 1] ** 2 + 2000 * dims[:, 0] * dims[:, 1] + 1e6
    return xpm.fit(xpm.CostFormula("a*bs*l^2 + b*bs*l + c", ["bs", "l"]), dims, peaks)[0]


def training_peak_bytes(dims: List[float]) -> float:
    """What training measures: more per bs*l^2, less per bs*l than the probes said."""
    records, length = dims
    return 6 * records * length ** 2 + 1200 * records * length + 1.05e6


def trained_sampler(steps: int) -> xpm.PredictiveBatchSampler:
    lengths = np.random.default_rng(11).integers(2, 200, 1003)
    sampler = xpm.PredictiveBatchSampler(lengths, probed_model(), BUDGET, outer_batch_size=64, seed=7,
                                         units=lengths)
    done = 0
    for microbatch in sampler:
        sampler.record_peak(microbatch, training_peak_bytes(microbatch.dims) if len(microbatch) else 0.0)
        if microbatch.last:
            sampler.mark_step_done()
            sampler.end_step(microbatch.step)
            done += 1
            if done == steps:
                break
    return sampler


def per_call_ms(call: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="trained steps before timing")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of each way")
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    args = parser.parse_args()
    sampler = trained_sampler(args.steps)
    refits = [line for line in sampler.calibration.log if "memory model refitted" in line]

    def reload() -> None:
        state = sampler.state_dict()
        state.update(epoch=0, steps_done=args.steps)
        sampler.load_state_dict(state)

    reloads, moves = [], []
    for _ in range(args.rounds):
        reloads.append(per_call_ms(reload, args.calls))
        moves.append(per_call_ms(lambda: sampler.resume_at(0, args.steps), args.calls))
    state_bytes = len(json.dumps(sampler.state_dict()))
    reload_ms, move_ms = statistics.median(reloads), statistics.median(moves)
    print(f"{args.steps} steps trained, {len(refits)} refit(s), state {state_bytes:,} bytes of JSON")
    print(f"state_dict + load_state_dict: {reload_ms:.3f} ms per step (median of {args.rounds})")
    print(f"resume_at:                    {move_ms:.4f} ms per step (median of {args.rounds})")
    print(f"ratio: {reload_ms / move_ms:,.0f}x")


if __name__ == "__main__":
    main()
