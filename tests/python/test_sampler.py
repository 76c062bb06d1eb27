"""PredictiveBatchSampler: a torch Sampler of microbatch index lists; every index once per epoch,
the same plan on every rank (defaults from a real gloo process group), an exact len, exact
resume (its own state_dict and torchdata's StatefulDataLoader), the plan's figures on every
microbatch, weights that make the accumulated gradient the outer batch's."""
import copy
import json
import os
import pathlib
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed
import torch.multiprocessing
from torch.utils.data import DataLoader, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

import xpm

BUDGET = 6_000_000


def fitted_model():
    formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + c", ["bs", "l"])
    dims = np.array([[1, 8], [4, 64], [16, 128], [32, 16], [8, 200]], dtype=float)
    fitted, _ = xpm.fit(formula, dims, 4 * dims[:, 0] * dims[:, 1] ** 2 + 2000 * dims[:, 0] * dims[:, 1] + 1e6)
    return fitted


@pytest.fixture(scope="module")
def model():
    return fitted_model()


@pytest.fixture(scope="module")
def lengths():
    return np.random.default_rng(11).integers(2, 200, 1003)


def sampler_for(model, lengths, rank=0, world_size=1, **kwargs):
    return xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, rank=rank,
                                      world_size=world_size, seed=7, units=lengths, **kwargs)


def identity(indices):
    """collate_fn that keeps the record indices (the dataset is range(n))."""
    return list(indices)


def test_every_index_exactly_once_per_epoch_and_microbatches_fit(model, lengths):
    sampler = sampler_for(model, lengths)
    assert isinstance(sampler, Sampler)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        seen = [i for microbatch in sampler for i in microbatch]
        assert sorted(seen) == list(range(len(lengths)))
        for microbatch in sampler:
            dims = [len(microbatch), float(lengths[microbatch].max())]
            assert model.predict(dims) <= BUDGET
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first  # a new permutation
    assert sampler.steps_per_epoch() == 16


def test_rank_and_world_size_default_to_one_process_without_a_process_group(model, lengths):
    assert not torch.distributed.is_initialized()
    sampler = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64)
    assert (sampler.rank, sampler.world_size) == (0, 1)
    assert sorted(i for mb in sampler for i in mb) == list(range(len(lengths)))
    simulated = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, rank=2, world_size=3)
    assert (simulated.rank, simulated.world_size) == (2, 3)


def run_rank(rank, store_path, out_dir, lengths, model_json):
    """One rank of a real gloo process group of 2: samplers built with defaults, and ones that
    contradict the group."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(store_path, 2), rank=rank,
                                         world_size=2)
    try:
        model = xpm.MemoryModel.from_json(model_json)
        lengths = np.asarray(lengths)
        sampler = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, seed=7, units=lengths)
        result = {"rank": sampler.rank, "world_size": sampler.world_size, "epochs": [], "errors": []}
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            length = len(sampler)
            microbatches = list(sampler)
            steps = sum(mb.last for mb in microbatches)
            # The ranks agree on the step count through the group itself.
            counts = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
            torch.distributed.all_gather(counts, torch.tensor([steps]))
            result["epochs"].append({"len": length, "microbatches": [list(mb) for mb in microbatches],
                                     "steps": steps, "all_steps": [int(c) for c in counts]})
        for kwargs in ({"rank": 1 - rank}, {"world_size": 3}, {"rank": rank, "world_size": 2}):
            try:
                xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, **kwargs)
                result["errors"].append(None)
            except ValueError as error:
                result["errors"].append(str(error))
    finally:
        torch.distributed.destroy_process_group()
    (pathlib.Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def test_ranks_of_a_gloo_group_share_every_record_once_with_the_defaults(model, lengths, tmp_path):
    torch.multiprocessing.spawn(run_rank, args=(str(tmp_path / "store"), str(tmp_path), lengths.tolist(),
                                                model.to_json()), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    for epoch in (0, 1):
        shares = [r["epochs"][epoch] for r in results]
        for share in shares:
            assert share["len"] == len(share["microbatches"])
            assert share["all_steps"] == [16, 16] and share["steps"] == 16
        records = [set(i for mb in share["microbatches"] for i in mb) for share in shares]
        assert not records[0] & records[1]
        assert sorted(i for share in shares for mb in share["microbatches"] for i in mb) == list(range(len(lengths)))
    assert results[0]["epochs"][0]["microbatches"] != results[0]["epochs"][1]["microbatches"]
    for rank, result in enumerate(results):
        wrong_rank, wrong_world, agreeing = result["errors"]
        assert wrong_rank == (f"rank={1 - rank} but torch.distributed says this process is rank {rank} of 2; "
                              "leave rank out to use torch.distributed's")
        assert wrong_world.startswith(f"world_size=3 but torch.distributed says this process is rank {rank} of 2")
        assert agreeing is None


def test_the_ranks_share_every_outer_batch_and_take_the_same_steps(model, lengths):
    world = 3
    samplers = [sampler_for(model, lengths, rank=r, world_size=world) for r in range(world)]
    again = sampler_for(model, lengths, rank=1, world_size=world)
    steps = [list(s.steps()) for s in samplers]
    assert len({len(s) for s in steps}) == 1 == len({s.steps_per_epoch() for s in samplers})
    assert [m.tolist() for st in steps[1] for m in st.microbatches] == \
           [m.tolist() for st in again.steps() for m in st.microbatches]  # deterministic
    # Another rank's plan, computed here: what that rank's sampler gives, from the same position.
    assert [(m.tolist(), w) for st in samplers[0].steps(rank=2) for m, w in zip(st.microbatches, st.weights)] == \
           [(m.tolist(), w) for st in steps[2] for m, w in zip(st.microbatches, st.weights)]
    again.load_state_dict({**again.state_dict(), "steps_done": 9})
    assert [m.tolist() for st in again.steps(rank=0) for m in st.microbatches] == \
           [m.tolist() for st in steps[0][9:] for m in st.microbatches]
    with pytest.raises(ValueError, match="rank must be in \\[0, 3\\), got 3"):
        again.steps(rank=3)
    all_indices = []
    for k in range(len(steps[0])):
        shares = [np.concatenate(steps[r][k].microbatches) for r in range(world)]
        all_indices += [i for share in shares for i in share.tolist()]
        # The same outer batch on every rank; its units split so the weights sum to world_size.
        assert sum(sum(steps[r][k].weights) for r in range(world)) == pytest.approx(world)
        a, b = model.coefficients["a"], model.coefficients["b"]
        costs = [float((a * lengths[share] ** 2 + b * lengths[share]).sum()) for share in shares]
        assert max(costs) < 1.1 * (sum(costs) / world)  # balanced by predicted cost
    assert sorted(all_indices) == list(range(len(lengths)))


def test_a_rank_without_records_still_joins_the_step(model):
    sampler = xpm.PredictiveBatchSampler([10, 20], model, BUDGET, outer_batch_size=2, rank=2, world_size=3)
    (step,) = list(sampler.steps())
    assert [m.tolist() for m in step.microbatches] == [[]] and step.weights == [0.0]
    (microbatch,) = list(sampler)
    assert microbatch == [] and microbatch.weight == 0.0 and microbatch.last and microbatch.step == 0
    assert microbatch.dims.tolist() == [0.0, 0.0] and microbatch.predicted_bytes == model.predict([0, 0])


@pytest.mark.parametrize("packer", xpm.PACKERS)
def test_microbatches_carry_the_plans_dims_and_predicted_bytes(model, lengths, packer, timed):
    model = timed(model)  # for "fastest"; the other packers ignore it
    world = 3
    for rank in range(world):  # not in lockstep: a share's plan is the packer's, never split further
        sampler = sampler_for(model, lengths, rank=rank, world_size=world, shuffle=False, packer=packer,
                              lockstep=False)
        microbatches = list(sampler)
        steps = list(sampler.steps())
        assert [mb.step for mb in microbatches] == [k for k, s in enumerate(steps) for _ in s.microbatches]
        assert [mb.last for mb in microbatches] == [j == len(s.microbatches) - 1 for s in steps
                                                    for j in range(len(s.microbatches))]
        assert [mb.weight for mb in microbatches] == [w for s in steps for w in s.weights]
        for mb in microbatches:
            assert isinstance(mb, xpm.Microbatch) and isinstance(mb, list)
            assert isinstance(mb.dims, np.ndarray) and isinstance(mb.predicted_bytes, float)
            assert mb.dims.tolist() == [len(mb), float(lengths[mb].max())]  # (records, padded length)
            assert mb.predicted_bytes == model.predict(mb.dims)
        # Without shuffling, this rank's share of an outer batch is in dataset order: xpm.plan of
        # it gives the very microbatches, dims and predictions.
        for k, step in enumerate(steps):
            share = np.sort(np.concatenate(step.microbatches))
            planned = xpm.plan(lengths[share], model, BUDGET, packer=packer)
            ours = [mb for mb in microbatches if mb.step == k]
            assert [list(mb) for mb in ours] == [share[m].tolist() for m in planned.microbatches]
            assert np.array_equal(np.stack([mb.dims for mb in ours]), planned.dims)
            assert [mb.predicted_bytes for mb in ours] == planned.predicted_bytes.tolist()
            assert step.predicted_bytes == planned.predicted_bytes.tolist()
            assert np.array_equal(np.stack(step.dims), planned.dims)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataloader_takes_it_as_its_batch_sampler(model, lengths, num_workers):
    sampler = sampler_for(model, lengths, world_size=2, rank=1)
    sampler.set_epoch(3)
    expected = [list(mb) for mb in sampler]
    loader = DataLoader(range(len(lengths)), batch_sampler=sampler, collate_fn=identity, num_workers=num_workers)
    with pytest.raises(ValueError, match="already deals rank 1's share of 2 ranks"):
        sampler.batch_size  # what a wrapper re-sharding batch samplers reads: refused at 2 ranks
    assert sampler_for(model, lengths).batch_size is None  # one rank: the sizes vary
    assert len(loader) == len(expected)
    assert list(loader) == expected
    # microbatch_loop over the DataLoader: each batch with its microbatch's weight and step end.
    looped = list(xpm.microbatch_loop(loader, sampler))
    assert sampler.state_dict()["steps_done"] == sampler.steps_per_epoch()
    assert len(sampler) == len(expected)  # the finished epoch starts over
    assert looped == [(list(mb), mb.weight, mb.last) for mb in sampler]
    # A plain DataLoader (its own BatchSampler) is refused, also after the sampler was iterated.
    plain = DataLoader(range(len(lengths)), batch_size=8, collate_fn=identity, num_workers=num_workers)
    with pytest.raises(RuntimeError, match="^microbatch_loop: the loader draws its batches from a BatchSampler, not "
                                           "the sampler; build it with DataLoader"):
        next(xpm.microbatch_loop(plain, sampler))


@pytest.mark.parametrize("size,outer,drop_last,world", [(1, 4, False, 1), (7, 3, False, 2), (63, 64, False, 1),
                                                         (64, 64, True, 3), (65, 64, True, 1), (300, 17, False, 4),
                                                         (1003, 64, False, 2), (1003, 100, True, 3)])
def test_len_is_exactly_what_the_next_pass_yields(model, size, outer, drop_last, world):
    lengths = np.random.default_rng(size).integers(1, 400, size)  # some alone over the budget
    for rank in range(world):
        sampler = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=outer, rank=rank,
                                             world_size=world, seed=size, drop_last=drop_last)
        for epoch in (0, 1, 5):
            sampler.set_epoch(epoch)
            expected = len(sampler)
            assert expected == len(list(iter(sampler))) == len(list(iter(sampler)))
            assert sum(len(s.microbatches) for s in sampler.steps()) == expected
            if drop_last and size < outer:
                assert expected == 0
        # After a resume at step 1: the rest of the epoch.
        state = {**sampler.state_dict(), "steps_done": min(1, sampler.steps_per_epoch())}
        resumed = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=outer, rank=rank,
                                             world_size=world, seed=size, drop_last=drop_last)
        resumed.load_state_dict(state)
        assert len(resumed) == len(list(resumed))


def test_state_dict_resumes_mid_epoch_with_exactly_the_rest(model, lengths):
    whole = sampler_for(model, lengths)
    whole.set_epoch(2)
    expected = list(whole)
    sampler = sampler_for(model, lengths)
    sampler.set_epoch(2)
    taken = []
    for batch, weight, last in xpm.microbatch_loop(iter(sampler), sampler):
        taken.append(batch)
        if last and sampler.state_dict()["steps_done"] == 5:
            break
    state = sampler.state_dict()
    resumed = sampler_for(model, lengths)
    resumed.load_state_dict(state)
    assert len(resumed) == len(expected) - len(taken)
    assert taken + [m for m in resumed] == expected
    # The state is the same on every rank: another rank's loads.
    sampler_for(model, lengths, rank=1, world_size=2).load_state_dict(sampler_for(model, lengths, rank=0,
                                                                                  world_size=2).state_dict())
    with pytest.raises(ValueError, match="seed"):
        xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, seed=8).load_state_dict(state)


def stateful_run(model, lengths, num_workers, state=None, stop_after=None, epoch=4, snapshot_every=1):
    """(batch, weight, last) of one pass of a StatefulDataLoader over a new sampler, resumed from
    ``state`` when given; stops after ``stop_after`` batches and returns the loader's state too."""
    sampler = sampler_for(model, lengths, world_size=2, rank=1)
    sampler.set_epoch(epoch)
    loader = StatefulDataLoader(range(len(lengths)), batch_sampler=sampler, collate_fn=identity,
                                num_workers=num_workers, snapshot_every_n_steps=snapshot_every)
    if state is not None:
        loader.load_state_dict(state)
    taken = []
    for item in xpm.microbatch_loop(loader, sampler):
        taken.append(item)
        if stop_after is not None and len(taken) == stop_after:
            return taken, loader.state_dict()
    return taken, None


# With workers the loader snapshots the sampler's iterator when it hands an index list to a
# worker, and replays the batches since the snapshot (every 5th batch: up to 4 replayed).
@pytest.mark.parametrize("num_workers,snapshot_every", [(0, 1), (2, 1), (2, 5)])
def test_a_stateful_dataloader_resumes_at_the_exact_microbatch(model, lengths, num_workers, snapshot_every):
    uninterrupted, _ = stateful_run(model, lengths, num_workers)
    lasts = [k for k, (_, _, last) in enumerate(uninterrupted) if last]
    assert len(lasts) == sampler_for(model, lengths).steps_per_epoch() == 16 and len(uninterrupted) > 30
    # Stop in the middle of a step (its first microbatch taken, not its last), at a step's end,
    # and early.
    step = next(k for k in range(2, 7) if lasts[k + 1] - lasts[k] >= 2)
    middle = lasts[step] + 2
    assert not uninterrupted[middle - 1][2]
    for stop in (middle, lasts[4] + 1, 3):
        taken, state = stateful_run(model, lengths, num_workers, stop_after=stop, snapshot_every=snapshot_every)
        assert taken == uninterrupted[:stop]
        rest, _ = stateful_run(model, lengths, num_workers, state=state, epoch=0,  # the state's epoch wins
                               snapshot_every=snapshot_every)
        assert [b for b, _, _ in rest] == [b for b, _, _ in uninterrupted[stop:]]
        assert rest == uninterrupted[stop:]  # the same weights and step ends too


def test_a_stateful_dataloader_state_taken_after_the_epoch_resumes_nothing(model, lengths):
    epoch_4, _ = stateful_run(model, lengths, 0)
    sampler = sampler_for(model, lengths, world_size=2, rank=1)
    loader = StatefulDataLoader(range(len(lengths)), batch_sampler=sampler, collate_fn=identity)
    loader.state_dict()  # before any pass
    for _ in loader:
        pass
    state = loader.state_dict()  # after the whole epoch 0
    resumed_sampler = sampler_for(model, lengths, world_size=2, rank=1)
    resumed = StatefulDataLoader(range(len(lengths)), batch_sampler=resumed_sampler, collate_fn=identity)
    resumed.load_state_dict(state)
    resumed_sampler.set_epoch(4)  # the next epoch, as a training loop sets it
    assert list(resumed) == [b for b, _, _ in epoch_4]


def test_the_iterator_state_refuses_another_plan(model, lengths):
    sampler = sampler_for(model, lengths)
    iterator = iter(sampler)
    next(iterator)
    state = iterator.state_dict()
    with pytest.raises(ValueError, match="usable_bytes"):
        iter(xpm.PredictiveBatchSampler(lengths, model, BUDGET // 2, outer_batch_size=64, seed=7,
                                        units=lengths)).load_state_dict(state)
    with pytest.raises(ValueError, match="rank"):
        iter(sampler_for(model, lengths, rank=1, world_size=2)).load_state_dict({**state, "world_size": 2})
    with pytest.raises(ValueError, match="position must be in"):
        iter(sampler_for(model, lengths)).load_state_dict({**state, "position": 10**6})
    other = iter(sampler_for(model, lengths))
    other.load_state_dict(state)
    assert list(other) == list(sampler)[1:]


def test_bad_arguments_name_the_value(model, lengths):
    with pytest.raises(ValueError, match="outer_batch_size must be >= 1, got 0"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=0)
    with pytest.raises(ValueError, match="rank must be in"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="units must be"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, units=[1, 2])
    # numpy's generator takes no negative seed: refused here, not when the epoch is first shuffled.
    with pytest.raises(ValueError, match="seed must be a whole number >= 0 .*, got -1"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, seed=-1)
    with pytest.raises(ValueError, match="^units are 0 for every record: "):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, units=np.zeros(len(lengths)))
    with pytest.raises(ValueError, match="units must be .* numbers >= 0 .one per record.: "):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, units=["a"] * len(lengths))
    # numpy would read text of digits and booleans as numbers; a record's units or dims are neither.
    with pytest.raises(ValueError, match="^units must be .* numbers >= 0 .one per record.: got text such as '3'$"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, units=["3"] * len(lengths))
    with pytest.raises(ValueError, match="^units must be .*: got bool such as True$"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, units=[True] * len(lengths))
    with pytest.raises(ValueError, match=r"^record_dims must be numbers \(\[n\] lengths .*: got text such as '\d+'$"):
        xpm.PredictiveBatchSampler([str(n) for n in lengths], model, 10**6, outer_batch_size=4)
    with pytest.raises(ValueError, match="^record_dims: no records$"):
        xpm.PredictiveBatchSampler(np.zeros((0, 2)), model, 10**6, outer_batch_size=4)
    with pytest.raises(ValueError, match="^record_dims_from_lengths: lengths must be numbers: "):
        xpm.record_dims_from_lengths(["a", "b"], ["bs", "l"])
    with pytest.raises(ValueError, match="epoch must be a whole number >= 0 .*, got -1"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4).set_epoch(-1)
    # A newcomer's: a name that is not the formula's, no ranks, the budget object itself.
    with pytest.raises(ValueError, match=r"^PredictiveBatchSampler: sort_by 'length' is not a variable of the formula "
                                         r"\(bs, l\); give one of them"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, sort_by="length")
    with pytest.raises(ValueError, match=r"^world_size must be >= 1 \(the number of ranks\), got 0$"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, rank=0, world_size=0)
    with pytest.raises(ValueError, match=r"^usable_bytes must be a number of bytes, got a MemoryBudget: pass its "
                                         r"\.usable_bytes$"):
        xpm.PredictiveBatchSampler(lengths, model, xpm.MemoryBudget(10**7), outer_batch_size=4)


def test_what_training_reports_is_checked_naming_the_value(model, lengths):
    """A peak given as text, a missing meter or a step that is not a whole number is refused in
    one line, before the calibration or the refit keeps anything of it."""
    sampler = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, seed=3, units=lengths)
    microbatch = next(iter(sampler))
    with pytest.raises(ValueError, match="^Calibration.record_peak: peak_bytes must be a finite number of bytes, "
                                         "got '1000000'$"):
        sampler.record_peak(microbatch, "1000000")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="^meter must be a meter .*, got None$"):
        sampler.record_microbatch_peak([0, 1], 1e6, None, "first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^end_step: step must be a whole number, got 'a'$"):
        sampler.end_step("a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^end_step: replan_from must be a whole number, got 2.5$"):
        sampler.end_step(0, replan_from=2.5)  # type: ignore[arg-type]
    assert sampler.calibration.measured_microbatches == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_nan_infinite_or_negative_records_and_units_name_the_first_bad_index(model, lengths, bad):
    units = lengths.astype(float)
    units[[17, 40]] = bad
    with pytest.raises(ValueError, match=r"^units\[17\] is (nan|inf|-1\.0): every record's units must be finite"):
        xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, units=units)
    spoiled = lengths.astype(float)
    spoiled[[5, 9]] = bad
    with pytest.raises(ValueError, match=r"^record_dims\[5\] is (nan|inf|-1\.0): every record's dims must be"):
        xpm.PredictiveBatchSampler(spoiled, model, BUDGET, outer_batch_size=64)
    dims = xpm.record_dims_from_lengths(lengths)
    dims[[33, 50], 1] = bad
    with pytest.raises(ValueError, match=r"^record_dims\[33\] is \[1\.0, (nan|inf|-1\.0)\]"):
        xpm.PredictiveBatchSampler(dims, model, BUDGET, outer_batch_size=64)


def test_a_finished_epoch_starts_over_and_bad_states_are_refused(model, lengths):
    sampler = sampler_for(model, lengths)
    first = list(sampler)
    assert list(sampler) == first  # no set_epoch: the same epoch again
    state = sampler.state_dict()
    for bad in (-3, 10**6, "2"):
        with pytest.raises(ValueError, match="steps_done must be in"):
            sampler_for(model, lengths).load_state_dict({**state, "steps_done": bad})
    with pytest.raises(ValueError, match="shuffle"):
        sampler_for(model, lengths, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="packer must be"):
        sampler_for(model, lengths, packer="nope")
    for packer in ("FFD", "Adaptive", None):  # the Literal's values only, spelt as they are
        with pytest.raises(ValueError) as caught:
            sampler_for(model, lengths, packer=packer)
        assert str(caught.value) == ("PredictiveBatchSampler: packer must be 'adaptive', 'fastest', 'ffd' or "
                                     f"'uniform', got {packer!r}")
    with pytest.raises(ValueError, match="outer_batch_size must be a whole number"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=2.5)
    with pytest.raises(ValueError, match=r"^usable_bytes must be a number of bytes in \[1, 2\*\*63\), got '8e5'$"):
        xpm.PredictiveBatchSampler(lengths, model, "8e5", outer_batch_size=2)
    floored = json.loads(model.to_json())
    floored["floor_bytes"] = 2_000_000.0
    with pytest.raises(ValueError, match=r"^usable_bytes 1000000 is below the model's floor_bytes 2000000 \(its steady "
                                         r"state and optimizer step\): no microbatch can fit; raise the budget$"):
        xpm.PredictiveBatchSampler(lengths, xpm.MemoryModel.from_json(json.dumps(floored)), 10**6, outer_batch_size=2)
    with pytest.raises(ValueError, match=r"^lockstep must be True, False or None \(at world size > 1: True\), got 'no'$"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=2, lockstep="no")
    with pytest.raises(ValueError, match="^CpuMeter.capacity_bytes must be a whole number of bytes >= 0"):
        xpm.CpuMeter.install().capacity_bytes = "1e6"
    with pytest.warns(RuntimeWarning, match="over the budget"):
        list(xpm.PredictiveBatchSampler([10, 5000], model, BUDGET, outer_batch_size=2))


def test_records_whose_batch_size_entry_is_not_1_are_refused_naming_the_first(model, lengths):
    dims = xpm.record_dims_from_lengths(lengths)
    swapped = np.ascontiguousarray(dims[:, ::-1])  # [l, bs]: the columns in the wrong order
    expected = (f"record_dims[0] is [{float(lengths[0])}, 1.0]: every record's 'bs' must be 1 (one record); "
                f"the columns must be the formula's variables in the order ['bs', 'l']")
    for make in (lambda: xpm.PredictiveBatchSampler(swapped, model, BUDGET, outer_batch_size=64),
                 lambda: xpm.plan(swapped, model, BUDGET)):
        with pytest.raises(ValueError) as error:
            make()
        assert str(error.value) == expected
    dims[7, 0] = 3  # a microbatch's dims given as a record's
    with pytest.raises(ValueError, match=r"^record_dims\[7\] is \[3\.0, \d+\.0\]: every record's 'bs' must be 1 "):
        xpm.PredictiveBatchSampler(dims, model, BUDGET, outer_batch_size=64)
    assert dims[7, 0] == 3 and dims[8, 0] == 1  # read, not changed


def test_records_far_beyond_the_probed_range_warn_once_naming_the_variable(model, lengths):
    assert model.probed_ranges == {"bs": (1.0, 32.0), "l": (8.0, 200.0)}
    within = np.minimum(lengths * 4, 800)  # up to 4x the largest probed length: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        steps = list(xpm.PredictiveBatchSampler(within, model, 10**9, outer_batch_size=64).steps())
    assert len(steps) == 16
    far = lengths.copy()
    far[5] = 900
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sampler = xpm.PredictiveBatchSampler(far, model, 10**9, outer_batch_size=64)
        list(sampler.steps())
        list(sampler)
    assert [str(w.message) for w in caught] == [
        "xpm: record_dims column 'l' reaches 900, 4.5x the largest 'l' the model was probed at (200): are the "
        "columns in the formula's order ['bs', 'l']? (predictions that far out are extrapolations)"]
    assert caught[0].category is RuntimeWarning and caught[0].filename == __file__


def test_plan_names_the_first_record_with_a_nan_an_infinity_or_a_negative_dim(model):
    for bad in (float("nan"), float("inf"), -2.0):
        with pytest.raises(ValueError) as error:
            xpm.plan([[1, 10], [1, 20], [1, bad]], model, BUDGET)
        assert str(error.value) == f"record_dims[2] is [1.0, {bad}]: record_dims must be finite and >= 0"


@pytest.mark.parametrize("world", [2, 3])
def test_lockstep_gives_every_rank_the_same_microbatch_count_in_every_step(model, lengths, world):
    """FSDP2's forward and backward are collectives: with lockstep=True every rank runs as many
    microbatches as the rank that needs the most, each still within the budget, every record
    once, and the weights still sum to the outer batch's."""
    def steps(rank, **kwargs):  # a tight budget: the ranks' shares pack into different counts
        return list(xpm.PredictiveBatchSampler(lengths, model, 2_000_000, outer_batch_size=64, rank=rank,
                                               world_size=world, seed=7, units=lengths, **kwargs).steps())

    free = [steps(rank, lockstep=False) for rank in range(world)]
    lock = [steps(rank, lockstep=True) for rank in range(world)]
    for rank in range(world):  # lockstep is the default at a world size above 1
        assert [[m.tolist() for m in step.microbatches] for step in steps(rank)] == \
            [[m.tolist() for m in step.microbatches] for step in lock[rank]]
    assert any(len({len(s[k].microbatches) for s in free}) > 1 for k in range(len(free[0]))), "nothing to equalize"
    seen = []
    for k in range(len(lock[0])):
        counts = [len(ranks[k].microbatches) for ranks in lock]
        assert len(set(counts)) == 1
        assert counts[0] == max(len(ranks[k].microbatches) for ranks in free)
        for ranks in lock:
            step = ranks[k]
            for microbatch, dims, predicted in zip(step.microbatches, step.dims, step.predicted_bytes):
                seen.extend(microbatch.tolist())
                if len(microbatch):
                    assert dims.tolist() == [len(microbatch), float(lengths[microbatch].max())]
                    assert predicted == pytest.approx(model.predict(dims)) and predicted <= 2_000_000
        assert sum(sum(ranks[k].weights) for ranks in lock) == pytest.approx(world)
    assert sorted(seen) == list(range(len(lengths)))


def measured_peak_bytes(microbatch, rank):
    """A peak that repeats whenever the same microbatch runs on the same rank: the model misses a
    buffer (a different one per rank) and 1 % of each prediction, and now and then, for some
    records, 50,000 to 150,000 bytes more (so that later steps raise the correction again)."""
    extra = 50_000 * (sum(microbatch) % 4) if sum(microbatch) % 17 == 0 else 0
    return microbatch.predicted_bytes * 1.01 + (40_000 if rank == 0 else 90_000) + extra


def calibrated_steps(sampler, rank, count):
    """`count` optimizer steps from the sampler's position, every microbatch's peak recorded and
    each step ended (one all-reduce): per step, its microbatches as (records, predicted, correction)."""
    steps, current = [], []
    for microbatch in sampler:
        current.append((list(microbatch), microbatch.predicted_bytes, microbatch.correction_bytes))
        sampler.record_peak(microbatch, measured_peak_bytes(microbatch, rank))
        if microbatch.last:
            sampler.mark_step_done()
            sampler.end_step(microbatch.step)
            steps.append(current)
            current = []
            if len(steps) == count:
                break
    return steps


def run_resumed_rank(rank, store_path, out_dir, lengths, model_json):
    """One rank of a gloo group of 2: 12 calibrated steps uninterrupted; then 5, the state saved, a
    fresh sampler loaded with it and 7 more."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(store_path, 2), rank=rank,
                                         world_size=2)
    try:
        model, lengths = xpm.MemoryModel.from_json(model_json), np.asarray(lengths)

        def fresh():
            return xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, seed=7, units=lengths)

        whole = fresh()
        uninterrupted = calibrated_steps(whole, rank, 12)
        first = fresh()
        before = calibrated_steps(first, rank, 5)
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint holds it
        resumed = fresh()
        resumed.load_state_dict(state)
        after = calibrated_steps(resumed, rank, 7)
        result = {"uninterrupted": uninterrupted, "resumed": before + after, "log": whole.calibration.log,
                  "resumed_log": resumed.calibration.log, "correction": list(whole.correction.__dict__.values()),
                  "resumed_correction": list(resumed.correction.__dict__.values())}
    finally:
        torch.distributed.destroy_process_group()
    (pathlib.Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))


def test_a_run_resumed_on_two_ranks_plans_what_the_uninterrupted_run_planned_calibration_included(
        model, lengths, tmp_path):
    """The peaks repeat, so the resumed run must plan, microbatch for microbatch, what the
    uninterrupted one did: the corrections agreed over the ranks travel in the state_dict."""
    torch.multiprocessing.spawn(run_resumed_rank, args=(str(tmp_path / "store"), str(tmp_path), lengths.tolist(),
                                                        model.to_json()), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["resumed"] == result["uninterrupted"]
        assert result["resumed_log"] == result["log"]
        assert len([line for line in result["log"] if not line.startswith(("step 0:", "step 1:", "step 2:",
                                                                             "step 3:", "step 4:"))]) >= 1
        assert result["resumed_correction"] == result["correction"]
    # One correction on both ranks, set by rank 1's larger miss (90,000 bytes).
    assert results[0]["correction"] == results[1]["correction"] and results[0]["correction"][0] >= 90_000
    corrections = [c for step in results[0]["uninterrupted"][1:] for _, _, c in step]
    assert min(corrections) > 0
    print(f"\ntwo ranks, 12 calibrated steps, resumed after 5: identical plans; {results[0]['log']}")


def test_calibration_plans_the_steps_not_handed_out_with_the_correction_and_resumes_them_exactly(model, lengths):
    """Peaks 20 % of the budget above their predictions in step 0: from step 1 on every
    microbatch is planned with the correction, and a sampler loaded with the state taken then
    yields the same remaining microbatches."""
    sampler = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, seed=3, units=lengths)
    plain = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, seed=3, units=lengths,
                                       calibrate=False)
    passing = iter(sampler)
    microbatch = next(passing)
    while True:
        sampler.record_peak(microbatch, microbatch.predicted_bytes + 0.2 * BUDGET)
        if microbatch.last:
            break
        microbatch = next(passing)
    sampler.mark_step_done()
    line = sampler.end_step(0)
    # A constant: the line of slope 0 through the points, then the headroom (0.25 % of each prediction).
    assert line == "step 0: correction +0.0 % -> +20.2 % of the budget (+1,200,000 bytes + 0.25 % of the prediction)"
    assert _lines(sampler.correction) == {(0.2 * BUDGET, 0.0025)}  # each position's line too: the same miss
    assert [p[0] for p in sampler.correction.positions] == ["first", "middle", "last"]
    assert sampler.correction_bytes == pytest.approx(BUDGET - 0.8 * BUDGET / 1.0025)
    state = sampler.state_dict()
    rest = list(passing)
    assert all(m.correction_bytes == pytest.approx(0.2 * BUDGET + 0.0025 * m.predicted_bytes) for m in rest if len(m))
    assert all(m.predicted_bytes + m.correction_bytes <= BUDGET for m in rest if len(m))
    assert sorted(i for m in rest for i in m) == sorted(i for step in list(plain.steps())[1:]
                                                          for m in step.microbatches for i in m.tolist())
    assert len(rest) > sum(len(step.microbatches) for step in list(plain.steps())[1:])  # smaller microbatches
    resumed = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, seed=3, units=lengths)
    resumed.load_state_dict(state)
    assert [list(m) for m in resumed] == [list(m) for m in rest]
    assert resumed.calibration.log == [line]
    # A step with nothing measured changes nothing.
    assert sampler.end_step(1) is None and _lines(sampler.correction) == {(0.2 * BUDGET, 0.0025)}


def _lines(correction):
    """The (intercept_bytes, slope) of a correction's line and of each position's."""
    return {(correction.intercept_bytes, correction.slope)} | {(i, s) for _, i, s, _, _ in correction.positions}


@pytest.mark.parametrize("missed, intercept_bytes, slope", [
    (lambda p: 0.02 * p, 0.0, 0.0225),            # the formula 2 % low: a share of each prediction
    (lambda p: 150_000.0, 150_000.0, 0.0025),     # a buffer the probes did not see: a constant
    (lambda p: 50_000.0 + 0.01 * p, 50_000.0, 0.0125),
])
def test_calibration_fits_a_line_over_the_peaks_constant_or_proportional(missed, intercept_bytes, slope):
    """What the probes missed, a constant or a share of the prediction, is corrected by the line
    through the measured points (its slope 0.25 % above, the headroom): no microbatch of the
    next step is under-predicted, and the smallest is not over-predicted by the largest's miss."""
    calibration = xpm.Calibration(BUDGET)
    predictions = [500_000.0, 1_200_000.0, 2_500_000.0, 4_000_000.0]
    for step in range(3):
        for p in predictions:
            calibration.record_peak(p, p + missed(p))
        calibration.end_step(step)
    correction = calibration.correction
    assert correction.slope == pytest.approx(slope)
    assert correction.intercept_bytes == pytest.approx(intercept_bytes, abs=1.0)
    for p in predictions:
        corrected, peak = p + correction.bytes_for(p), p + missed(p)
        assert 0 <= (corrected - peak) / peak < 0.003


def test_calibration_refuses_a_peak_that_is_not_a_number_of_bytes():
    calibration = xpm.Calibration(BUDGET)
    for predicted, peak, name in ((1e6, float("nan"), "peak_bytes"), (float("inf"), 1e6, "predicted_bytes"),
                                  (1e6, -1.0, "peak_bytes"), (1e6, "1000000", "peak_bytes"),
                                  (True, 1e6, "predicted_bytes")):
        with pytest.raises(ValueError, match=f"^Calibration.record_peak: {name} must be a finite number of bytes"):
            calibration.record_peak(predicted, peak)
    for step, replan_from in (("a", 0), (-1, 0), (0, 1.5), (10 ** 30, 0)):
        with pytest.raises(ValueError, match="^Calibration.end_step: (step|replan_from) must be a whole number"):
            calibration.end_step(step, replan_from=replan_from)
    calibration.record_peak(0, 1e6)  # an empty microbatch's prediction: skipped
    assert calibration.measured_microbatches == 0


def test_calibration_raises_at_once_and_lowers_once_the_window_settles_under_a_lower_line():
    calibration = xpm.Calibration(BUDGET, window_steps=4, settle_steps=3)
    calibration.record_peak(1_000_000, 1_000_000)
    calibration.end_step(0)                                       # the run's first step
    calibration.record_peak(1_000_000, 1_100_000)
    assert calibration.end_step(1) is not None                    # 100,000 bytes over: at once
    raised = calibration.correction
    assert raised.bytes_for(1_000_000) >= 100_000
    lines = []
    for step in range(2, 7):
        calibration.record_peak(1_000_000, 1_010_000)
        lines.append(calibration.end_step(step))
    # Settled (3 steps in the window) only at step 3, but the window of 4 holds step 1 until
    # step 5: lower then, to the line over steps 2 to 5, and no change after.
    assert lines == [None, None, None, lines[3], None] and lines[3] is not None
    assert 10_000 <= calibration.correction.bytes_for(1_000_000) < raised.bytes_for(1_000_000)


@pytest.mark.parametrize("lower_early", [True, False])
def test_calibration_lowers_an_over_prediction_early_with_more_headroom_and_fully_once_settled(lower_early):
    calibration = xpm.Calibration(BUDGET, settle_steps=2, lower_early=lower_early)
    calibration.record_peak(2_000_000, 2_000_000)
    calibration.end_step(0)
    assert calibration.correction == xpm.Correction()
    after = []
    for step in (1, 2):
        calibration.record_peak(2_000_000, 1_700_000)             # 15 % over-predicted
        line = calibration.end_step(step)
        after.append(calibration.correction.bytes_for(2_000_000))
    # After one step: 1 % of the prediction more headroom (EARLY_HEADROOM_SLOPE), or no change.
    early = -300_000 + (0.0025 + xpm.calibration.EARLY_HEADROOM_SLOPE) * 2_000_000
    assert after[0] == (pytest.approx(early) if lower_early else 0.0)
    assert line is not None and after[1] == pytest.approx(-300_000, rel=0.02)


def test_calibration_settings_that_are_not_whole_numbers_or_bools_are_refused():
    with pytest.raises(ValueError, match="settle_steps must be a whole number >= 1, got 0"):
        xpm.Calibration(BUDGET, settle_steps=0)
    with pytest.raises(ValueError, match="^Calibration: lower_early must be True or False, got 'yes'$"):
        xpm.Calibration(BUDGET, lower_early="yes")  # type: ignore[arg-type]


def test_a_lowering_positions_line_keeps_its_share_outside_its_range():
    """TRL's SFTTrainer: a constant of -6.0 MB drawn over 83 MB last microbatches takes off no
    more than its share there (-6.9 %) of a 31.5 MB one; a first microbatch above its range
    keeps its own line, not the common one over the less over-predicted last ones."""
    sft = xpm.Correction(-1_792_588.0, -0.0475, (("first", -14_029_049.0, 0.0025, 164_881_656.0, 164_881_656.0),
                                                 ("last", -5_962_060.0, 0.0025, 83_389_448.0, 83_389_448.0)))
    share = (-5_962_060.0 + 0.0025 * 83_389_448.0) / 83_389_448.0
    assert sft.bytes_for(31_514_365, "last") == pytest.approx(share * 31_514_365)
    assert sft.bytes_for(168_603_001, "first") == pytest.approx(-14_029_049.0 + 0.0025 * 168_603_001)


def test_a_positions_line_below_and_above_the_predictions_it_measured():
    """Its own line in its range; outside it, the larger of it and the common line, which below
    the range grows no further than at its low end (the planner's rule, one copy)."""
    tilted = xpm.Correction(31_692.0, -0.01, (("last", 10_256.0, 0.005, 1_374_005.0, 1_432_373.0),))
    assert tilted.bytes_for(1_400_000, "last") == pytest.approx(17_256)
    assert tilted.bytes_for(473_484, "last") == pytest.approx(31_692 - 13_740.05)   # not 26,957
    assert tilted.bytes_for(473_484, "first") == pytest.approx(31_692 - 4_734.84)   # no line of its own
    assert tilted.bytes_for(473_484) == pytest.approx(31_692 - 4_734.84)
    assert tilted.bytes_for(3_000_000, "last") == pytest.approx(25_256)
    assert tilted.planning_bytes(10_000_000) == pytest.approx(min((10_000_000 - 31_692) / 0.99,
                                                                 (10_000_000 - 10_256) / 1.005))
    with pytest.raises(ValueError, match="position"):
        tilted.bytes_for(500_000, "end")  # type: ignore[arg-type]


def test_a_calibration_state_of_a_constant_correction_still_loads():
    calibration = xpm.Calibration(BUDGET)
    calibration.load_state_dict({"correction_bytes": 120_000.0, "window": [130_000.0], "steps_seen": 3,
                                 "log": ["step 1: correction +0.0 % -> +2.0 % of the budget (+120,000 bytes)"]})
    assert calibration.correction == xpm.Correction(120_000.0, 0.0)
    with pytest.raises(ValueError, match="calibration state_dict"):
        calibration.load_state_dict({"correction": [1.0], "window": [], "steps_seen": 0, "log": []})


def test_an_fsdp2_step_of_one_microbatch_is_predicted_with_the_larger_of_its_phases():
    """A model with FSDP2's phases (fits below the steady one): in a step of several microbatches
    the first is predicted without gradients and the last synchronised; a step of one microbatch
    is both, so it gets the larger of the two."""
    formula = xpm.CostFormula("a*bs*l + c", ["bs", "l"])
    dims = np.array([[1, 8], [4, 64], [16, 128], [32, 16], [8, 200]], dtype=float)
    steady, _ = xpm.fit(formula, dims, 100 * dims[:, 0] * dims[:, 1] + 1e5)
    model = steady._with_phase("without_gradients", [60.0, 1e5], 1.0, 0.0, len(dims))
    model = model._with_phase("synchronised", [80.0, 1e5], 1.0, 0.0, len(dims))
    lengths = np.full(16, 50)
    one = next(iter(xpm.PredictiveBatchSampler(lengths, model, 10_000_000, outer_batch_size=16).steps()))
    assert len(one.microbatches) == 1
    assert one.predicted_bytes[0] == pytest.approx(80 * 16 * 50 + 1e5)
    several = next(iter(xpm.PredictiveBatchSampler(lengths, model, 100 * 4 * 50 + 1e5, outer_batch_size=16).steps()))
    assert len(several.microbatches) > 1
    first, last = several.dims[0], several.dims[-1]
    assert several.predicted_bytes[0] == pytest.approx(60 * first[0] * first[1] + 1e5)
    assert several.predicted_bytes[-1] == pytest.approx(80 * last[0] * last[1] + 1e5)



def test_ranks_get_balanced_shares_under_a_formula_with_a_branch_without_the_batch_size(lengths):
    """max(a*bs*l + c, b*l^2 + d), a formula `formula="auto"` can choose: one record of l >= 34
    predicts no more than none (the b*l^2 branch), so costs of records alone would send the long
    ones to one rank; a record's share of a full microbatch of its kind balances the ranks."""
    text = json.loads(fitted_model().to_json())
    text["formula"] = {"text": "max(a*bs*l + c, b*l^2 + d)", "canonical": "max(a*bs*l + c, b*l^2 + d)",
                       "coefficient_names": ["a", "c", "b", "d"], "variable_names": ["bs", "l"]}
    text["coefficients"] = {"a": 2000.0, "c": 1e6, "b": 60.0, "d": 1e6}
    model = xpm.MemoryModel.from_json(json.dumps(text))
    assert model.predict([1, 100]) == model.predict([0, 100])  # alone, a long record adds nothing
    ranks = [list(xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, rank=rank, world_size=2,
                                             seed=7, units=lengths).steps()) for rank in range(2)]
    # Per step, the ranks run in lockstep: the step lasts as long as its heavier share.
    tokens = np.array([[sum(float(lengths[m].sum()) for m in step.microbatches) for step in steps] for steps in ranks])
    records = [sum(len(m) for step in steps for m in step.microbatches) for steps in ranks]
    heaviest = tokens.max(axis=0).sum() / (tokens.sum() / 2)
    print(f"\nmax(a*bs*l + c, b*l^2 + d), 2 ranks: records {records}, heavier share of a step "
          f"{heaviest:.3f}x the mean, microbatches {sum(len(s.microbatches) for s in ranks[0])} per rank")
    assert sum(records) == len(lengths)
    assert heaviest < 1.03


@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda sampler: pickle.loads(pickle.dumps(sampler))],
                         ids=["deepcopy", "pickle"])
def test_a_calibrated_sampler_copied_between_steps_yields_what_the_original_yields(model, lengths, copy_of):
    """A copy (``copy.deepcopy``, or pickled as a DataLoader's spawned workers or a checkpoint
    would) taken after a calibrated step keeps the model, the correction and its window: it
    yields the remaining microbatches the original yields, with the same corrections."""
    sampler = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, seed=3, units=lengths)
    passing = iter(sampler)
    microbatch = next(passing)
    while not microbatch.last:
        sampler.record_peak(microbatch, microbatch.predicted_bytes + 0.1 * BUDGET)
        microbatch = next(passing)
    sampler.record_peak(microbatch, microbatch.predicted_bytes + 0.1 * BUDGET)
    sampler.mark_step_done()
    line = sampler.end_step(0)
    copied = copy_of(sampler)
    rest = list(passing)
    assert copied.calibration.log == [line] and copied.correction == sampler.correction
    again = list(copied)
    assert [list(m) for m in again] == [list(m) for m in rest]
    assert [m.correction_bytes for m in again] == [m.correction_bytes for m in rest]
    assert copied.state_dict() == sampler.state_dict()


@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda c: pickle.loads(pickle.dumps(c))], ids=["deepcopy", "pickle"])
def test_a_copied_calibration_keeps_its_settings_and_its_initial_line(copy_of):
    """A copy starts a position not yet measured from the same initial line (a model's reserved
    gap), and lowers as the original does."""
    calibration = xpm.Calibration(BUDGET, settle_steps=3, lower_early=False, initial=xpm.Correction(50_000.0, 0.01))
    copied = copy_of(calibration)
    assert (copied.settle_steps, copied.lower_early) == (3, False)
    for c in (calibration, copied):
        c.record_peak(1_000_000, 1_000_000, "middle")
        c.end_step(0)
    assert copied.correction == calibration.correction
    assert copied.correction.bytes_for(1_000_000, "middle") == pytest.approx(60_000)


def test_a_calibration_with_a_group_of_its_own_is_deep_copied_sharing_it_but_not_pickled():
    group = object()  # stands for a process group: a handle of this process
    calibration = xpm.Calibration(BUDGET, group=group)
    assert copy.deepcopy(calibration).group is group
    with pytest.raises(TypeError, match="process group of its own cannot be pickled"):
        pickle.dumps(calibration)


def test_each_position_of_a_step_is_corrected_by_its_own_line(model, lengths):
    """The last microbatch of every step peaks 300,000 bytes above its prediction (an optimizer
    step's temporaries), the others as predicted: from the next step on the last microbatches
    are planned with that miss and the others without it, the packing fits both lines, and a
    resumed sampler plans the same."""
    sampler = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, seed=3, units=lengths)
    passing = iter(sampler)
    for microbatch in passing:
        assert microbatch.position == xpm.microbatch_position(*_index_and_count(sampler, microbatch))
        sampler.record_peak(microbatch, microbatch.predicted_bytes + (300_000 if microbatch.last else 0))
        if microbatch.last:
            sampler.mark_step_done()
            sampler.end_step(microbatch.step)
            break
    state = sampler.state_dict()
    rest = [m for m in passing if len(m)]
    assert {m.position for m in rest} >= {"first", "middle", "last"}
    for m in rest:
        expected = sampler.correction.bytes_for(m.predicted_bytes, m.position)
        assert m.correction_bytes == pytest.approx(expected)
        assert m.predicted_bytes + m.correction_bytes <= BUDGET
    # Outside the predictions a position measured (one step: one or a few), the larger of its
    # line and the common one, which tilts to cover both kinds of points.
    assert all(m.correction_bytes >= 300_000 for m in rest if m.position == "last")
    assert all(m.correction_bytes < 200_000 for m in rest if m.position != "last")
    resumed = xpm.PredictiveBatchSampler(lengths, model, BUDGET, outer_batch_size=64, seed=3, units=lengths)
    resumed.load_state_dict(state)
    again = [m for m in resumed if len(m)]
    assert [(list(m), m.correction_bytes, m.position) for m in again] == \
        [(list(m), m.correction_bytes, m.position) for m in rest]


def _index_and_count(sampler, microbatch):
    """The microbatch's index among its step's microbatches with records, and their count."""
    step = list(sampler.steps())[microbatch.step]
    kept = [list(mb) for mb in step.microbatches if len(mb)]
    return kept.index(list(microbatch)), len(kept)


def test_a_peak_recorded_for_what_is_not_a_microbatch_the_sampler_yielded_is_refused(model, lengths):
    """``record_peak`` and ``record_meter_peak`` take the ``Microbatch`` the sampler yielded (its
    dims and prediction are what is recorded): a plain list of records or None is refused in one
    line naming it, and nothing is recorded."""
    sampler = sampler_for(model, lengths)
    meter = xpm.CpuMeter.install()
    expected = ("{}: microbatch must be a Microbatch the sampler yielded (iter(sampler), with its dims and "
                "predicted_bytes), got {}; a microbatch known by its records: record_microbatch_peak(records, "
                "predicted_bytes, meter, position)")
    for bad, shown in (([1, 2, 3], "a list: [1, 2, 3]"), (None, "None")):
        with pytest.raises(TypeError) as caught:
            sampler.record_peak(bad, 1e6)  # type: ignore[arg-type]
        assert str(caught.value) == expected.format("record_peak", shown)
        with pytest.raises(TypeError) as caught:
            sampler.record_meter_peak(bad, meter)  # type: ignore[arg-type]
        assert str(caught.value) == expected.format("record_meter_peak", shown)
    assert sampler.calibration.measured_microbatches == 0


def test_a_microbatch_recorded_by_records_must_hold_indices_and_only_lockstep_empty_ones_none(model, lengths):
    """``record_microbatch_peak`` refuses records that are no list of indices, and an empty list
    given a position (an empty microbatch, lockstep's of weight 0, has none); the empty
    microbatches lockstep packs, with no position, are skipped as accelerate's loop records every
    microbatch it trains."""
    sampler = sampler_for(model, lengths)
    meter = xpm.CpuMeter.install()
    with pytest.raises(ValueError) as caught:
        sampler.record_microbatch_peak([], 1e6, meter, "middle")
    assert str(caught.value) == ("record_microbatch_peak: records is empty but position is 'middle': an empty "
                                 "microbatch (lockstep's, weight 0) has no position in its step and no peak of its "
                                 "own; give the records of the microbatch measured, or position None for an empty one")
    for bad, shown in ((None, "None"), ([[1, 2]], "[[1, 2]]"), ([[1], [1, 2]], "[[1], [1, 2]]"), ("12", "'12'")):
        with pytest.raises(ValueError) as caught:
            sampler.record_microbatch_peak(bad, 1e6, meter, "middle")  # type: ignore[arg-type]
        assert str(caught.value) == f"record_microbatch_peak: records must be indices of the sampler's 1003 records, " \
                                    f"got {shown}"
    assert sampler.calibration.measured_microbatches == 0
    # Rank 0 packs its two records into two microbatches; rank 1 its one and an empty one.
    locked = xpm.PredictiveBatchSampler([790, 790, 10], model, BUDGET, outer_batch_size=3, rank=1, world_size=2)
    microbatches = list(locked)
    assert [(list(m), m.position) for m in microbatches] == [([1], "alone"), ([], None)]
    for m in microbatches:
        xpm.meters.start_peak(meter)
        held = torch.ones(10_000)  # a peak of 40 kB
        locked.record_microbatch_peak(list(m), m.predicted_bytes, meter, m.position)
        del held
    assert locked.calibration.measured_microbatches == sum(1 for m in microbatches if len(m))


def test_a_calibration_budget_that_is_not_a_whole_number_of_bytes_is_refused_naming_it():
    for bad in (True, 1.5, "1e6", 0, -5, None, float("nan")):
        with pytest.raises(ValueError) as caught:
            xpm.Calibration(bad)  # type: ignore[arg-type]
        assert str(caught.value) == f"Calibration: usable_bytes must be a whole number of bytes > 0, got {bad!r}"
    assert xpm.Calibration(6e6).usable_bytes == 6_000_000  # a float of a whole value, as MemoryBudget takes
    assert xpm.Calibration(np.int64(BUDGET)).usable_bytes == BUDGET
    with pytest.raises(TypeError, match=r"^Calibration: initial must be an xpm.Correction or None, got tuple "
                                        r"\(1.0, 0.0\)$"):
        xpm.Calibration(BUDGET, initial=(1.0, 0.0))  # type: ignore[arg-type]


def _ended_steps(sampler, count):
    """Ends the first ``count`` steps of a pass over ``sampler``, each microbatch's predicted peak
    recorded, and returns the pass (under way)."""
    passing = iter(sampler)
    for microbatch in passing:
        sampler.record_peak(microbatch, microbatch.predicted_bytes)
        if microbatch.last:
            sampler.mark_step_done()
            sampler.end_step(microbatch.step)
            if microbatch.step == count - 1:
                return passing
    return passing


@pytest.mark.parametrize("calibrate", [True, False])
def test_end_step_refuses_a_step_ended_twice_out_of_order_or_beyond_the_epoch(model, lengths, calibrate):
    """Each step ended counts for the calibration and the refit's schedule: a step ended again,
    one before the last ended, or one beyond the epoch is refused in one line, counting nothing."""
    sampler = sampler_for(model, lengths, calibrate=calibrate)
    _ended_steps(sampler, 3)
    before = None if sampler.calibration is None else sampler.calibration.state_dict()
    again = "each step of an epoch is ended once, in order (set_epoch starts another epoch)"
    for step, says in ((2, f"end_step: step 2 was ended already: {again}"),
                       (1, f"end_step: step 1 comes before the last step ended, 2: {again}"),
                       (0, f"end_step: step 0 comes before the last step ended, 2: {again}"),
                       (16, "end_step: step 16 is beyond the epoch's 16 steps (0 to 15)"),
                       (-1, "end_step: step must be a whole number >= 0, got -1")):
        with pytest.raises(ValueError) as caught:
            sampler.end_step(step)
        assert str(caught.value) == says
    assert (None if sampler.calibration is None else sampler.calibration.state_dict()) == before
    sampler.end_step(3)  # the next one


def test_a_peak_recorded_after_its_step_ended_is_refused(model, lengths):
    """A peak recorded after ``end_step`` (late, or a second time) would count in the next step's
    calibration and refit: refused in one line, nothing recorded; the next step's are taken."""
    sampler = sampler_for(model, lengths)
    passing = iter(sampler)
    kept = []
    for microbatch in passing:
        sampler.record_peak(microbatch, microbatch.predicted_bytes)
        kept.append(microbatch)
        if microbatch.last:
            sampler.end_step(microbatch.step)
            break
    before = sampler.calibration.state_dict()
    for record in (lambda mb: sampler.record_peak(mb, mb.predicted_bytes),
                   lambda mb: sampler.record_meter_peak(mb, xpm.CpuMeter.install())):
        with pytest.raises(ValueError, match=r"^record_(meter_)?peak: the microbatch is of step 0, which end_step "
                                             r"ended already \(the last ended: step 0\); record a step's peaks "
                                             r"before its end_step$"):
            record(kept[0])
    assert sampler.calibration.state_dict() == before
    following = next(passing)
    assert following.step == 1
    sampler.record_peak(following, following.predicted_bytes)


def test_end_step_takes_the_steps_again_in_another_epoch_pass_or_state(model, lengths):
    """The steps start over with ``set_epoch``, a pass that begins before them (the epoch
    iterated again), a state loaded from before them; and step 0, with no pass of the sampler
    under way, starts the epoch over (Lightning's planned_dataloader with worker processes: their
    copies iterate the epochs, the trainer's sampler ends every epoch's steps)."""
    sampler = sampler_for(model, lengths)
    _ended_steps(sampler, 3)
    state = sampler.state_dict()
    sampler.set_epoch(1)
    _ended_steps(sampler, 2)
    resumed = sampler_for(model, lengths)
    resumed.load_state_dict(state)  # epoch 0, steps_done 3
    resumed.end_step(3)
    with pytest.raises(ValueError, match="^end_step: step 3 was ended already"):
        resumed.end_step(3)
    resumed.load_state_dict({**state, "steps_done": 1})  # from before step 1: steps 1 on again
    resumed.end_step(1)
    # The drop-in HF Trainer ends a step and loads the state saying it is done: the same step
    # again is refused, the next one taken.
    resumed.load_state_dict({**resumed.state_dict(), "steps_done": 2})
    with pytest.raises(ValueError, match="^end_step: step 1 was ended already"):
        resumed.end_step(1)
    resumed.end_step(2)
    # A finished epoch iterated again (no set_epoch): its steps from 0 again.
    whole = sampler_for(model, lengths)
    for _ in range(2):
        _ended_steps(whole, whole.steps_per_epoch())
    # No pass under way: every epoch's steps ended from 0 without set_epoch.
    ended = sampler_for(model, lengths)
    for _ in range(2):
        for step in range(ended.steps_per_epoch()):
            ended.end_step(step)
    with pytest.raises(ValueError, match="^end_step: step 3 comes before the last step ended, 15"):
        ended.end_step(3)


def test_a_state_whose_corrections_do_not_start_at_step_0_or_leave_the_epoch_is_refused(model, lengths):
    """Each correction is planned from its first step, the first from step 0; one drawn at the
    epoch's last step plans from the step after it, the epoch's step count, at most."""
    state = sampler_for(model, lengths).state_dict()
    line = [0.0, 0.0, {}]
    for firsts in ([3], [], [0, -2], [0, 17], [0, 5, 5], [0, 2.5], [0, "3"]):
        with pytest.raises(ValueError) as caught:
            sampler_for(model, lengths).load_state_dict({**state, "corrections": [[f, *line] for f in firsts]})
        assert str(caught.value) == ("state_dict corrections' first steps must be whole numbers from 0, increasing, "
                                     f"at most the epoch's 16 steps; got {firsts!r}")
    sampler_for(model, lengths).load_state_dict({**state, "corrections": [[0, *line], [16, 1000.0, 0.0, {}]]})


def test_what_would_make_a_state_unloadable_or_fail_later_is_refused_at_once(model, lengths):
    """A newcomer's finds: each was accepted and then broke a later load or plan."""
    sampler = sampler_for(model, lengths)
    _ended_steps(sampler, 1)
    steps = sampler.steps_per_epoch()
    with pytest.raises(ValueError, match=rf"^end_step: replan_from must be a step in \[0, {steps}\] \(the epoch's "
                                         r"steps, or its end\), got 1000$"):
        sampler.end_step(1, replan_from=1000)
    with pytest.raises(ValueError, match=r"^resume_at: epoch must be a whole number >= 0 \(it seeds the shuffle\), "
                                         r"got -1$"):
        sampler.resume_at(-1, 0)
    state = sampler.state_dict()
    nan_line = [[0, float("nan"), 0.0, {}]]
    with pytest.raises(ValueError, match=r"^state_dict corrections must be \[\[step, intercept_bytes, slope"):
        sampler_for(model, lengths).load_state_dict({**state, "corrections": nan_line})
    sampler.resume_at(0, steps - 1)
    sampler.mark_step_done()
    with pytest.raises(ValueError, match=rf"^mark_step_done: the epoch's {steps} steps are all done already"):
        sampler.mark_step_done()
    sampler_for(model, lengths).load_state_dict(sampler.state_dict())  # what it wrote loads
    for budget in (1e30, 2 ** 70, 0.5, float("nan")):
        with pytest.raises(ValueError, match=r"^usable_bytes must be a number of bytes in \[1, 2\*\*63\), got "):
            xpm.PredictiveBatchSampler(lengths, model, budget, outer_batch_size=64)
        with pytest.raises(ValueError, match=r"^Calibration: usable_bytes must be a whole number of bytes > 0"):
            xpm.Calibration(budget)  # type: ignore[arg-type]


class _ReadingMeter:
    """A meter whose peak reads ``peak`` (a meter of one's own, with a bug)."""

    def __init__(self, peak, reserves_segments=False):
        self.peak_allocated_bytes = self.peak_reserved_bytes = peak
        self.reserves_segments = reserves_segments


@pytest.mark.parametrize("name", ["shuffle", "drop_last", "calibrate", "gradients_set_to_none"])
def test_a_bool_option_given_anything_but_true_or_false_is_refused(model, lengths, name):
    """A newcomer's find: ``calibrate='no'`` calibrated, the string being true."""
    for value in ("no", 0, None):
        with pytest.raises(ValueError, match=rf"^PredictiveBatchSampler: {name} must be True or False, "
                                             rf"got {value!r}$"):
            sampler_for(model, lengths, **{name: value})
    numpy_false = sampler_for(model, lengths, **{name: np.False_})  # numpy's bools are bools
    assert numpy_false.state_dict() == sampler_for(model, lengths, **{name: False}).state_dict()
    assert sampler_for(model, lengths, calibrate=np.False_).calibration is None


def test_a_correction_that_is_not_a_finite_number_is_refused():
    """A newcomer's find: ``Correction('a', 'b')`` and ``Correction(nan)`` were kept."""
    for intercept, slope, says in (("a", "b", "intercept_bytes must be a finite number of bytes, got 'a'"),
                                   (float("nan"), 0.0, "intercept_bytes must be a finite number of bytes, got nan"),
                                   (True, 0.0, "intercept_bytes must be a finite number of bytes, got True"),
                                   (0.0, float("inf"), "slope must be a finite number, got inf"),
                                   (0.0, None, "slope must be a finite number, got None")):
        with pytest.raises(ValueError, match=f"^Correction: {says}$"):
            xpm.Correction(intercept, slope)
    correction = xpm.Correction(np.float64(1000.0), np.int64(0))
    assert correction.bytes_for(1e6) == 1000.0


def test_calibration_refuses_more_settle_steps_than_its_window_holds():
    """A newcomer's find: ``settle_steps=8, window_steps=4`` was settled at 4 steps silently."""
    with pytest.raises(ValueError, match=r"^Calibration: settle_steps 8 is more than window_steps 4 \(a lower "
                                         r"correction .*\): give settle_steps <= 4$"):
        xpm.Calibration(BUDGET, settle_steps=8, window_steps=4)
    # Without settle_steps: 8, or the window's steps when it holds fewer.
    assert xpm.Calibration(BUDGET, window_steps=4).settle_steps == 4
    assert xpm.Calibration(BUDGET).settle_steps == 8
    calibration = xpm.Calibration(BUDGET, settle_steps=4, window_steps=4)
    assert (calibration.settle_steps, calibration.window_steps) == (4, 4)


def test_a_sampler_without_record_dims_is_a_type_error_naming_the_argument(model, lengths):
    """A newcomer's find: ``PredictiveBatchSampler(None, ...)`` raised an AttributeError inside."""
    with pytest.raises(TypeError, match=r"^PredictiveBatchSampler: record_dims must be the records' dims \(\[n\] "
                                        r"lengths or \[n, variables\] dims\), got None$"):
        xpm.PredictiveBatchSampler(None, model, BUDGET, outer_batch_size=64)
    with pytest.raises(ValueError, match="^record_dims must be numbers .*: got non-numbers such as None$"):
        xpm.PredictiveBatchSampler([None, None], model, BUDGET, outer_batch_size=64)


@pytest.mark.parametrize("peak", [float("nan"), None, "1000000"])
def test_a_meter_whose_peak_is_not_a_number_of_bytes_is_refused_naming_its_attribute(model, lengths, peak):
    """A newcomer's find: a meter's NaN, None or text peak reached a bare ``int()``. Refused in one
    line, nothing kept (a reserving meter leaves ``lower_early`` as it was)."""
    sampler = sampler_for(model, lengths)
    microbatch = next(iter(sampler))
    with pytest.raises(ValueError, match=rf"^meter.peak_allocated_bytes must be a number of bytes in \[0, 2\*\*63\), "
                                         rf"got {peak!r} from a _ReadingMeter$"):
        sampler.record_meter_peak(microbatch, _ReadingMeter(peak))
    calibration = xpm.Calibration(BUDGET)
    with pytest.raises(ValueError, match=r"^meter.peak_reserved_bytes must be a number of bytes in "):
        calibration.record_meter_peak(1e6, _ReadingMeter(peak, reserves_segments=True))
    assert calibration.lower_early and calibration.measured_microbatches == 0
    assert sampler.calibration.measured_microbatches == 0
    sampler.record_meter_peak(microbatch, _ReadingMeter(microbatch.predicted_bytes))  # it still records
    assert sampler.calibration.measured_microbatches == 1


def test_messages_say_the_limit_a_whole_number_and_an_epoch_without_steps(model, lengths):
    """A newcomer's finds: 1e30 bytes was called not finite, ``steps_done=2.0`` out of range, and an
    epoch without steps a range of "(0 to -1)"."""
    sampler = sampler_for(model, lengths)
    microbatch = next(iter(sampler))
    for peak in (1e30, 10 ** 400):
        with pytest.raises(ValueError, match=r"^Calibration.record_peak: peak_bytes must be a number of bytes below "
                                             r"2\*\*63 \(8 EiB, the most the planner counts\), got 1"):
            sampler.record_peak(microbatch, peak)
    assert sampler.calibration.measured_microbatches == 0
    state = sampler.state_dict()
    with pytest.raises(ValueError, match=r"^resume_at: steps_done must be a whole number, got 2.0$"):
        sampler.resume_at(0, 2.0)  # type: ignore[arg-type]
    assert sampler.state_dict() == state
    sampler.resume_at(0, 2)
    assert sampler.state_dict()["steps_done"] == 2
    empty = xpm.PredictiveBatchSampler(lengths[:10], model, BUDGET, outer_batch_size=64, drop_last=True)
    assert empty.steps_per_epoch() == 0
    with pytest.raises(ValueError, match=r"^end_step: step 0: the epoch has no steps \(drop_last left out its only "
                                         r"outer batch, shorter than outer_batch_size\), so there is none to end$"):
        empty.end_step(0)
