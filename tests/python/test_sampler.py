"""PredictiveBatchSampler: every index once per epoch, the same plan on every rank, exact resume,
weights that make the accumulated gradient the outer batch's."""
import numpy as np
import pytest

import xpm


@pytest.fixture(scope="module")
def model():
    formula = xpm.CostFormula("a*bs*l^2 + b*bs*l + c", ["bs", "l"])
    dims = np.array([[1, 8], [4, 64], [16, 128], [32, 16], [8, 200]], dtype=float)
    fitted, _ = xpm.fit(formula, dims, 4 * dims[:, 0] * dims[:, 1] ** 2 + 2000 * dims[:, 0] * dims[:, 1] + 1e6)
    return fitted


@pytest.fixture(scope="module")
def lengths():
    return np.random.default_rng(11).integers(2, 200, 1003)


def sampler_for(model, lengths, rank=0, world_size=1, **kwargs):
    return xpm.PredictiveBatchSampler(lengths, model, 6_000_000, outer_batch_size=64, rank=rank,
                                      world_size=world_size, seed=7, units=lengths, **kwargs)


def test_every_index_exactly_once_per_epoch_and_microbatches_fit(model, lengths):
    sampler = sampler_for(model, lengths)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        seen = [i for microbatch in sampler for i in microbatch]
        assert sorted(seen) == list(range(len(lengths)))
        for microbatch in sampler:
            dims = [len(microbatch), float(lengths[microbatch].max())]
            assert model.predict(dims) <= 6_000_000
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first  # a new permutation
    assert len(sampler) == len(list(sampler))
    assert sampler.steps_per_epoch() == 16


def test_the_ranks_share_every_outer_batch_and_take_the_same_steps(model, lengths):
    world = 3
    samplers = [sampler_for(model, lengths, rank=r, world_size=world) for r in range(world)]
    again = sampler_for(model, lengths, rank=1, world_size=world)
    steps = [list(s.steps()) for s in samplers]
    assert len({len(s) for s in steps}) == 1 == len({s.steps_per_epoch() for s in samplers})
    assert [m.tolist() for st in steps[1] for m in st.microbatches] == \
           [m.tolist() for st in again.steps() for m in st.microbatches]  # deterministic
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
    sampler = xpm.PredictiveBatchSampler([10, 20], model, 6_000_000, outer_batch_size=2, rank=2, world_size=3)
    (step,) = list(sampler.steps())
    assert [m.tolist() for m in step.microbatches] == [[]] and step.weights == [0.0]


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
    assert taken + [m for m in resumed] == expected
    with pytest.raises(ValueError, match="seed"):
        xpm.PredictiveBatchSampler(lengths, model, 6_000_000, outer_batch_size=64, seed=8).load_state_dict(state)


def test_bad_arguments_name_the_value(model, lengths):
    with pytest.raises(ValueError, match="outer_batch_size must be >= 1, got 0"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=0)
    with pytest.raises(ValueError, match="rank must be in"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="units must be"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=4, units=[1, 2])


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
    with pytest.raises(ValueError, match="outer_batch_size must be a whole number"):
        xpm.PredictiveBatchSampler(lengths, model, 10**6, outer_batch_size=2.5)
    with pytest.warns(RuntimeWarning, match="over the budget"):
        list(xpm.PredictiveBatchSampler([10, 5000], model, 6_000_000, outer_batch_size=2))
