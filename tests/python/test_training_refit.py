"""The sampler's memory model refitted on the peaks training measures (``xpm.sampler_refit``, the
planner's ``xpm::TrainingRefit``): where the probes' fit errs by amounts no calibration line in
the prediction takes off, the model is refitted, the calibration drawn anew, and the plans of
the steps not handed out follow both; the same on every rank, and a run resumed from a state
plans what the uninterrupted run planned.
"""
import json
import os
import pathlib
import pickle

import numpy as np
import pytest
import torch

import xpm

# What the probes gave (the sampler tests' model): 4 bytes per bs*l^2, 2,000 per bs*l and 1 MB.
from test_sampler import BUDGET, fitted_model as probed_model  # noqa: E402 - beside this file


def training_peak_bytes(dims):
    """What training measures: more per bs*l^2, less per bs*l, so that the probes' model errs by
    a share of its prediction that differs from shape to shape (no line in the prediction
    covers it without over-predicting the rest)."""
    records, length = dims
    return 6 * records * length ** 2 + 1200 * records * length + 1.05e6


def lengths():
    return np.random.default_rng(11).integers(2, 200, 1003)


def sampler_of(model, rank=None, world_size=None):
    return xpm.PredictiveBatchSampler(lengths(), model, BUDGET, outer_batch_size=64, seed=7, units=lengths(),
                                      rank=rank, world_size=world_size)


def trained_steps(sampler, count):
    """``count`` optimizer steps from the sampler's position, each microbatch's training peak
    recorded and each step ended: per step, its microbatches as (records, predicted, correction,
    peak)."""
    steps, current = [], []
    for microbatch in sampler:
        peak = training_peak_bytes(microbatch.dims) if len(microbatch) else 0.0
        current.append((list(microbatch), microbatch.predicted_bytes, microbatch.correction_bytes, peak))
        sampler.record_peak(microbatch, peak)
        if microbatch.last:
            sampler.mark_step_done()
            sampler.end_step(microbatch.step)
            steps.append(current)
            current = []
            if len(steps) == count:
                break
    return steps


def refits(log):
    """``[(step, line), ...]`` of the refits in a calibration's log."""
    return [(int(line.split(":")[0].split()[-1]), line) for line in log if "memory model refitted" in line]


def refit_step(log):
    """The step of the one refit in a calibration's log."""
    taken = refits(log)
    assert len(taken) == 1, log
    return taken[0]


def test_a_model_that_errs_by_shape_is_refitted_and_its_plans_follow_the_training_peaks():
    model = probed_model()
    sampler = sampler_of(model)
    steps = trained_steps(sampler, 12)
    # Refitted once the steps after the run's first held 9 points of a step's middle or end (3
    # per coefficient), and not again: the refit explains every later peak.
    step, line = refit_step(sampler.calibration.log)
    assert step == 3 and line.startswith("step 3: memory model refitted on 9 training peaks (a*bs*l^2 + b*bs*l + c)")
    # Before: the probes' model alone erred from one shape to the next by 12 % to 29 % of the
    # peak, and the calibration's lines left the plans 0.6 % to 8.1 % over.
    before = [(p - peak) / peak for s in steps[:step + 1] for _, p, _, peak in s if peak]
    assert max(before) - min(before) > 0.1
    # From the step after it: every microbatch's model alone within 0.01 %, planned (prediction
    # plus the calibration's correction) within -1 % / +3 % of its peak, within the budget.
    later = [m for s in steps[step + 1:] for m in s if m[3]]
    alone = [(p - peak) / peak for _, p, _, peak in later]
    planned = [(p + c - peak) / peak for _, p, c, peak in later]
    assert -1e-4 < min(alone) and max(alone) < 1e-4
    assert -0.01 <= min(planned) and max(planned) <= 0.03
    assert all(p + c <= BUDGET for _, p, c, _ in later)
    # The sampler plans with the refit, which holds where training measured: beyond the longest
    # record seen, at least the model given; its JSON carries the region and reads back alike.
    refitted = sampler.model
    region = json.loads(refitted.to_json())["refit_region"]["training_ranges"]  # {variable: [min, max]}
    longest = float(lengths().max())
    assert refitted.predict([2, longest + 50]) >= model.predict([2, longest + 50])
    inside = [round((low + high) / 2) for low, high in (region[name] for name in ("bs", "l"))]
    assert refitted.predict(inside) == pytest.approx(training_peak_bytes(inside), rel=1e-4)
    again = xpm.MemoryModel.from_json(refitted.to_json())
    assert again.predict([2, longest + 50]) == refitted.predict([2, longest + 50])
    print(f"\n{line}\nbefore, the model alone {100 * min(before):+.2f} % to {100 * max(before):+.2f} %; after, "
          f"planned {100 * min(planned):+.2f} % to {100 * max(planned):+.2f} %")


def test_a_refitted_sampler_pickled_or_resumed_plans_what_it_would_have_planned():
    model = probed_model()
    sampler = sampler_of(model)
    trained_steps(sampler, 5)
    assert refit_step(sampler.calibration.log)[0] == 3
    state = json.loads(json.dumps(sampler.state_dict()))  # as a checkpoint holds it
    copied = pickle.loads(pickle.dumps(sampler))
    resumed = sampler_of(model)
    resumed.load_state_dict(state)
    ahead = [[(r, p, c) for r, p, c, _ in step] for step in trained_steps(sampler, 4)]
    assert [[(r, p, c) for r, p, c, _ in step] for step in trained_steps(copied, 4)] == ahead
    assert [[(r, p, c) for r, p, c, _ in step] for step in trained_steps(resumed, 4)] == ahead
    assert resumed.calibration.log == sampler.calibration.log


def run_resumed_rank(rank, store_path, out_dir, model_json):
    """One rank of a gloo group of 2: 10 trained steps uninterrupted; then 3, the state saved, a
    fresh sampler loaded with it and 7 more."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(store_path, 2), rank=rank,
                                         world_size=2)
    try:
        model = xpm.MemoryModel.from_json(model_json)
        whole = sampler_of(model)
        uninterrupted = trained_steps(whole, 10)
        first = sampler_of(model)
        before = trained_steps(first, 3)
        resumed = sampler_of(model)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
        after = trained_steps(resumed, 7)
        result = {"uninterrupted": uninterrupted, "resumed": before + after, "log": whole.calibration.log,
                  "resumed_log": resumed.calibration.log}
    finally:
        torch.distributed.destroy_process_group()
    (pathlib.Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def test_two_ranks_refit_alike_and_a_resumed_run_plans_what_the_uninterrupted_run_planned(tmp_path):
    torch.multiprocessing.spawn(run_resumed_rank, args=(str(tmp_path / "store"), str(tmp_path),
                                                        probed_model().to_json()), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["resumed"] == result["uninterrupted"]
        assert result["resumed_log"] == result["log"]
    # Both ranks refitted on both ranks' peaks, at the same steps, to the same models: after the
    # state was saved (3 steps), the resumed run refits from the window it restored (a state saved
    # after a refit resumes the refitted model: the test above). A second refit, where a step
    # showed shapes beyond the first one's region, is taken alike.
    taken = refits(results[0]["log"])
    assert taken and refits(results[1]["log"]) == taken and taken[0][0] >= 3
    step, line = taken[-1]
    later = [(p + c - peak) / peak for r in results for s in r["uninterrupted"][step + 1:] for _, p, c, peak in s
             if peak]
    assert -0.01 <= min(later) and max(later) <= 0.03
    print(f"\ntwo ranks: {line}; resumed after 3 of 10 steps: identical plans")


def test_a_microbatch_recorded_by_records_that_are_not_the_samplers_is_refused():
    sampler = sampler_of(probed_model())
    meter = xpm.CpuMeter.install()
    for records in ([0, 1003], [-1], [0.5]):
        try:
            sampler.record_microbatch_peak(records, 1e6, meter, "middle")
        except ValueError as error:
            assert str(error).startswith("record_microbatch_peak: records must be indices of the sampler's 1003 "
                                         "records, got ")
        else:
            raise AssertionError(f"{records} accepted")


def test_a_state_whose_refit_is_malformed_or_of_another_model_is_refused_in_one_line():
    sampler = sampler_of(probed_model())
    trained_steps(sampler, 5)
    state = json.loads(json.dumps(sampler.state_dict()))
    other = xpm.fit(xpm.CostFormula("a*bs*l + c", ["bs", "l"]), np.array([[1, 8], [4, 64], [16, 128]], dtype=float),
                    np.array([2e6, 3e6, 9e6]))[0]
    cases = [({"training_refit": "garbage"}, "state_dict training_refit must be {'state': ..., 'models': "),
             ({"training_refit": {**state["training_refit"], "models": 5}}, "training_refit must be"),
             ({"training_refit": {"models": state["training_refit"]["models"]}}, "training_refit must be"),
             ({"training_refit": {**state["training_refit"], "models": [[0, "a*bs*l + c", None, None]]}},
              "got the entry ['a*bs*l + c', None, None]"),
             ({"training_refit": {**state["training_refit"],
                                  "models": [[0, None, None, None], [5.7, None, None, None]]}},
              "the models' first steps must be whole numbers from 0, increasing; got [0, 5.7]"),
             ({"training_refit": {**state["training_refit"],
                                  "models": [[0, None, None, None],
                                             [4, "a*bs*l + c", {"a": -1e9, "c": -5.0}, [[1, 9], [2, 199]]]]}},
              "coefficient 'a' must be a finite number >= 0"),
             ({"training_refit": {**state["training_refit"],
                                  "models": [[0, None, None, None], [4, "a*bs*l + c", {"a": 1.0, "c": 5.0}, [[1, 9]]]]}},
              "1 refit region ranges for 2 variables"),
             ({"training_refit": {**state["training_refit"],
                                  "models": [[0, None, None, None], [4, "a*bs*l + c", {"a": 1.0, "c": 5.0}, None]]}},
              "got the entry ['a*bs*l + c', {'a': 1.0, 'c': 5.0}, None]")] + _more_malformed_refits(state)
    for change, says in cases:
        resumed = sampler_of(probed_model())
        before = resumed.state_dict()
        try:
            resumed.load_state_dict({key: value for key, value in {**state, **change}.items() if value is not _GONE})
        except ValueError as error:
            assert says in str(error) and "\n" not in str(error), str(error)
        else:
            raise AssertionError(f"{change} accepted")
        assert resumed.state_dict() == before, change  # refused before anything changed
    # A state measured against another model (probed again): the refit starts anew, with a warning.
    elsewhere = xpm.PredictiveBatchSampler(lengths(), other, BUDGET, outer_batch_size=64, seed=7, units=lengths())
    with pytest.warns(RuntimeWarning, match="model refit was measured against another memory model"):
        elsewhere.load_state_dict(state)
    assert elsewhere._model is other


_GONE = object()
"""A key taken out of a state (``_more_malformed_refits``)."""


def _more_malformed_refits(state):
    """``(change, what the error says)`` of a state's ``training_refit`` removed, corrupted in its
    models or in the planner refit's state, each refused in one line naming the field."""
    refit = state["training_refit"]
    given, last = refit["models"]  # the model given from step 0, the refit from step 4
    coefficients = {name: 2 * value for name, value in last[2].items()}
    (low, high), lengths_range = last[3]

    def models(*entries):
        return {"training_refit": {**refit, "models": list(entries)}}

    def native(**change):
        return {"training_refit": {**refit, "state": {key: value for key, value in {**refit["state"], **change}.items()
                                                      if value is not _GONE}}}
    missing = "but the state has a calibration: a calibrating sampler of this model writes both"
    return [({"training_refit": None}, f"state_dict training_refit is None {missing}"),
            ({"training_refit": _GONE}, f"state_dict training_refit is missing {missing}"),
            (models(given, [last[0], last[1], last[2], [[high, low], lengths_range]]),
             f"state_dict training_refit models[1]: the training range of 'bs' is [{high}, {low}]: it must be "
             "[min, max] with 0 <= min <= max"),
            (models(given, [last[0], last[1], last[2], [[-3.0, high], lengths_range]]),
             "models[1]: the training range of 'bs' is [-3.0, "),
            (models(given, [500, *last[1:]]),
             "state_dict training_refit: the models' first steps must be at most the epoch's 16 steps; got [0, 500]"),
            (models(given, [last[0], last[1], coefficients, last[3]]),
             "state_dict training_refit models[1] (the model the latest steps are planned with) must be the refit its "
             "state holds, but its coefficients "),
            (models(given), "models[0] (the model the latest steps are planned with) must be the refit its state "
                            "holds, but its formula None and the state's 'a*bs*l^2 + b*bs*l + c' differ"),
            (native(coefficients=_GONE), "state_dict training_refit state has no 'coefficients' (a refit's state "
                                         "holds window, steps_seen, "),
            (native(coefficients="x"), "state_dict training_refit state formula, coefficients and training_ranges "
                                       "must be None (no refit) or "),
            (native(given=_GONE), "state_dict training_refit state has no 'given'"),
            (native(log="x"), "state_dict training_refit state log must be a list of lines of text, got 'x'"),
            (native(steps_seen=-2), "state_dict training_refit state steps_seen must be a whole number >= 0, got -2"),
            (native(window="x"), "state_dict training_refit state window must be a list of steps, got 'x'"),
            (native(window=[{"step": 0, "points": []}]), "state_dict training_refit state window[0] must be "
                                                         "{'step': whole number >= 0, 'run_first': bool, 'points': "),
            (native(window=[{**refit["state"]["window"][0], "points": [[8.0, "199", 1.0, 0]]}]),
             "state_dict training_refit state window[0] points[0] must be 4 numbers: 2 dims and the peak bytes "
             "(finite, >= 0), then the position (-1: none, 0 to 3), got [8.0, '199', 1.0, 0]"),
            (native(training_ranges=[[low, high]]),
             "state_dict training_refit state: 1 refit region ranges for 2 variables ['bs', 'l']")]


def test_states_a_sampler_writes_load_with_a_refit_first_or_at_the_epochs_end_or_no_calibration():
    """What a sampler writes loads: a refit taken at the epoch's last step plans from the step
    after it (the epoch's step count), the next epoch starts with the refit in force (its first
    model a refit), and a state written without calibration has no refit to load."""
    model = probed_model()

    def fresh(**kwargs):
        return xpm.PredictiveBatchSampler(lengths(), model, BUDGET, outer_batch_size=128, seed=7, units=lengths(),
                                          **kwargs)
    sampler = fresh()
    trained_steps(sampler, sampler.steps_per_epoch())
    state = json.loads(json.dumps(sampler.state_dict()))
    assert [entry[0] for entry in state["training_refit"]["models"]] == [0, 3, 8] == [0, 3, sampler.steps_per_epoch()]
    fresh().load_state_dict(state)
    sampler.set_epoch(1)
    state = json.loads(json.dumps(sampler.state_dict()))
    (first,) = state["training_refit"]["models"]
    assert first[0] == 0 and first[1] is not None
    resumed = fresh()
    resumed.load_state_dict(state)
    assert [list(m) for m in resumed] == [list(m) for m in sampler]
    plain = fresh(calibrate=False).state_dict()
    assert plain["calibration"] is None and "training_refit" not in plain
    fresh().load_state_dict(plain)


def test_resume_at_is_the_own_state_loaded_at_another_step():
    """``resume_at`` moves where the state resumes and keeps the calibration and the refit, as
    loading the sampler's own state with its position changed does (the HF drop-in calls it
    after every step instead of writing and reading the refit's window)."""
    loaded = sampler_of(probed_model())
    trained_steps(loaded, 5)
    moved = pickle.loads(pickle.dumps(loaded))
    state = loaded.state_dict()
    state.update(epoch=0, steps_done=3)
    loaded.load_state_dict(state)
    moved.resume_at(0, 3)
    assert moved.state_dict() == loaded.state_dict()
    ahead = [[(r, p, c) for r, p, c, _ in step] for step in trained_steps(loaded, 4)]
    assert [[(r, p, c) for r, p, c, _ in step] for step in trained_steps(moved, 4)] == ahead
    with pytest.raises(ValueError, match=rf"resume_at: steps_done must be in \[0, {moved.steps_per_epoch()}\], got 99"):
        moved.resume_at(0, 99)
