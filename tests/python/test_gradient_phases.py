"""The phases of an optimizer step as training loops run them: after ``zero_grad()`` (set_to_none,
torch 2.x's default) a step's first microbatch runs without gradients and peaks lower than the
later ones. ``xpm.probe`` measures that phase at every probe shape and fits it; the sampler
predicts each step's first microbatch with it. Checked against the real training microbatches of
a model of this file's own (a convolutional next-token model whose gradients are a large share of
its memory), trained under a CPU cap that splits every outer batch."""
import json

import numpy as np
import pytest
import torch

import xpm

torch.set_num_threads(1)
METER = xpm.CpuMeter.install()  # before any model: the meter must see the weights
VOCAB = 3000
FORMULA = xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"])


class ConvLm(torch.nn.Module):
    """Tokens -> embedding 48 -> two 1-D convolutions -> next-token logits over VOCAB (the
    embedding and the head hold most of the 1.3 MB of parameters)."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(VOCAB, 48)
        self.conv1 = torch.nn.Conv1d(48, 96, 5, padding=2)
        self.conv2 = torch.nn.Conv1d(96, 48, 3, padding=1)
        self.head = torch.nn.Linear(48, VOCAB)

    def loss_sum(self, tokens):
        x = self.embedding(tokens[:, :-1]).transpose(1, 2)
        x = self.conv2(torch.relu(self.conv1(x))).transpose(1, 2)
        return torch.nn.functional.cross_entropy(self.head(x).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1),
                                                 reduction="sum")


def random_tokens(dims):
    return torch.randint(1, VOCAB, (int(dims[0]), int(dims[1])))


def probed(measure_phases=True, cap_above_static=30_000_000):
    torch.manual_seed(0)
    model = ConvLm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cap = METER.current_allocated_bytes + cap_above_static
    METER.capacity_bytes = cap
    outcome = xpm.probe(model, optimizer, lambda dims: model.loss_sum(random_tokens(dims)), FORMULA, meter=METER,
                        variable_max={"bs": 32, "l": 64}, measure_phases=measure_phases)
    return model, optimizer, outcome, cap


def train_one_epoch(model, optimizer, outcome, cap, **sampler_options):
    """Rows (step, position in the step, measured peak, predicted, correction, the
    with-gradients prediction, last) of every microbatch, the sampler, and the OOMs of training."""
    lengths = np.random.default_rng(2).integers(4, 64, 512)
    texts = [torch.randint(1, VOCAB, (int(n),)) for n in lengths]
    sampler = xpm.PredictiveBatchSampler(lengths, outcome.model, xpm.MemoryBudget(cap).usable_bytes,
                                         outer_batch_size=64, seed=1, units=lengths - 1, **sampler_options)
    rows, position, ooms = [], 0, METER.oom_count
    for microbatch, weight, last in xpm.microbatch_loop(iter(sampler), sampler, meter=METER):
        batch = torch.zeros(len(microbatch), max(len(texts[i]) for i in microbatch), dtype=torch.long)
        for row, i in enumerate(microbatch):
            batch[row, :len(texts[i])] = texts[i]
        (weight * model.loss_sum(batch) / float(sum(len(texts[i]) - 1 for i in microbatch))).backward()
        if last:
            optimizer.step()
            optimizer.zero_grad()  # set_to_none=True: the next step's first microbatch has no gradients
        rows.append((microbatch.step, position, METER.peak_allocated_bytes, microbatch.predicted_bytes,
                     microbatch.correction_bytes, outcome.model.predict(microbatch.dims), last))
        position = 0 if last else position + 1
    return rows, sampler, METER.oom_count - ooms


@pytest.fixture(scope="module")
def trained():
    try:
        model, optimizer, outcome, cap = probed()
        rows, sampler, ooms = train_one_epoch(model, optimizer, outcome, cap)
    finally:
        METER.capacity_bytes = 0
    return outcome, rows, sampler, ooms


def test_the_probe_fits_the_phase_without_gradients_below_the_steady_one_by_about_the_gradients(trained):
    outcome, _, _, _ = trained
    model = outcome.model
    assert model.phases == ["with_gradients", "without_gradients"]
    phase = model.phase_report("without_gradients")
    gradient_bytes = sum(p.numel() * p.element_size() for p in ConvLm().parameters())
    assert abs(phase["max_rel_error"]) < 0.01 and phase["fitted_points"] >= 3
    # Same activations per record and token; the constant lower by about one gradient's bytes.
    assert phase["coefficients"]["a"] == pytest.approx(model.coefficients["a"], rel=0.02)
    assert model.coefficients["c"] - phase["coefficients"]["c"] == pytest.approx(gradient_bytes, rel=0.1)
    dims = [[8, 40], [20, 60], [1, 10]]
    assert np.all(model.predict(dims, "without_gradients") <= model.predict(dims))


def test_every_microbatch_from_the_third_step_is_predicted_within_1_percent_and_none_is_under_planned(trained):
    outcome, rows, sampler, ooms = trained
    floor = outcome.model.floor_bytes
    later = [row for row in rows if row[0] >= 2 and row[2] > floor]
    # The model alone, on the forward/backward phases (the last microbatch's peak is the
    # optimizer step's, predicted by the floor): within 1.5 % both ways.
    raw = [(row[3] - row[2]) / row[2] for row in later if not row[6]]
    planned = [(predicted + correction - measured) / measured for _, _, measured, predicted, correction, _, _ in later]
    assert ooms == 0 and len(later) > 20
    assert min(raw) > -0.015 and max(raw) < 0.015, (min(raw), max(raw))
    # As planned: none under by more than 1 %; over by the spread of the model's own errors at
    # most (this model's convolutions change kernels with the batch size: -2 % to +1 % raw).
    assert min(planned) > -0.01 and max(planned) < 0.04, (min(planned), max(planned), sampler.calibration.log)
    # The first microbatches, which the with-gradients model alone over-predicts by more than 3 %.
    firsts = [(row[5] - row[2]) / row[2] for row in later if row[1] == 0 and not row[6]]
    firsts_phase = [(row[3] - row[2]) / row[2] for row in later if row[1] == 0 and not row[6]]
    assert min(firsts) > 0.03 and max(map(abs, firsts_phase)) < 0.015
    print(f"\nfrom step 3, {len(later)} microbatches: model {100 * min(raw):+.2f} % to {100 * max(raw):+.2f} %, "
          f"as planned (with the correction) {100 * min(planned):+.2f} % to {100 * max(planned):+.2f} %; "
          f"first microbatches {100 * min(firsts_phase):+.2f} % to {100 * max(firsts_phase):+.2f} % "
          f"(the with-gradients model alone: {100 * min(firsts):+.2f} % to {100 * max(firsts):+.2f} %); "
          f"{sampler.calibration.log}")


def test_a_first_of_several_microbatches_is_predicted_without_the_optimizer_steps_floor(trained):
    outcome, rows, _, _ = trained
    model = outcome.model
    small = [1, 4]  # the floor (the optimizer step's peak) is above the phase's fit here
    assert model.predict(small, "without_gradients") == model.floor_bytes
    assert model.predict(small, "without_gradients", floor=False) < model.floor_bytes
    assert model.predict(small, floor=False) == model.predict(small)  # no phase fit of its own: as floored
    firsts = [row for row in rows if row[1] == 0 and not row[6]]
    assert firsts and all(row[3] <= row[5] for row in firsts)


def test_the_phase_travels_with_the_model_json_and_file(trained, tmp_path):
    model = trained[0].model
    again = xpm.MemoryModel.from_json(model.to_json())
    assert again.phases == model.phases
    assert again.predict([12, 50], "without_gradients") == model.predict([12, 50], "without_gradients")
    model.save(tmp_path / "memory_model.json")
    loaded = xpm.MemoryModel.load(tmp_path / "memory_model.json")
    assert loaded.phase_report("without_gradients") == model.phase_report("without_gradients")
    assert "without_gradients" in json.loads((tmp_path / "memory_model.json").read_text())["metadata"]["phases"]


def test_a_loop_that_keeps_its_gradients_gets_the_steady_prediction_for_every_microbatch(trained):
    outcome = trained[0]
    lengths = np.random.default_rng(5).integers(4, 64, 128)
    kept = xpm.PredictiveBatchSampler(lengths, outcome.model, 20_000_000, outer_batch_size=64,
                                      gradients_set_to_none=False)
    freed = xpm.PredictiveBatchSampler(lengths, outcome.model, 20_000_000, outer_batch_size=64)
    for a, b in zip(kept, freed):
        assert list(a) == list(b)  # the same packing either way
        assert a.predicted_bytes == outcome.model.predict(a.dims)
        assert b.predicted_bytes <= a.predicted_bytes


def test_without_measure_phases_the_model_has_one_phase_and_predicts_it_for_both():
    try:
        _, _, outcome, _ = probed(measure_phases=False)
    finally:
        METER.capacity_bytes = 0
    assert outcome.model.phases == ["with_gradients"]
    assert outcome.model.predict([8, 40], "without_gradients") == outcome.model.predict([8, 40])
    with pytest.raises(ValueError, match="this model has no fit of 'without_gradients'"):
        outcome.model.phase_report("without_gradients")


def test_a_phase_that_is_no_gradient_phase_is_refused_in_one_line(trained):
    with pytest.raises(ValueError) as error:
        trained[0].model.predict([8, 40], "first")
    assert "phase" in str(error.value) and "'first'" in str(error.value) and "\n" not in str(error.value)


def test_a_loop_that_keeps_its_gradients_is_detected_and_its_first_microbatches_predicted_with_them(trained):
    """The sampler's default assumes zero_grad(set_to_none=True); a loop that zeroes in place,
    given to microbatch_loop as module=, is caught at the first step that starts with gradients:
    one warning, and from that step on each first microbatch is predicted with gradients."""
    outcome = trained[0]
    torch.manual_seed(2)
    model = ConvLm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lengths = np.random.default_rng(6).integers(4, 64, 192)
    texts = [torch.randint(1, VOCAB, (int(n),)) for n in lengths]
    sampler = xpm.PredictiveBatchSampler(lengths, outcome.model, 20_000_000, outer_batch_size=64, calibrate=False)
    firsts = []
    with pytest.warns(RuntimeWarning, match="gradients_set_to_none=False") as caught:
        position = 0
        for microbatch, weight, last in xpm.microbatch_loop(iter(sampler), sampler, module=model):
            if position == 0:
                firsts.append((microbatch.step, microbatch.predicted_bytes, outcome.model.predict(microbatch.dims)))
            batch = torch.zeros(len(microbatch), max(len(texts[i]) for i in microbatch), dtype=torch.long)
            for row, i in enumerate(microbatch):
                batch[row, :len(texts[i])] = texts[i]
            (weight * model.loss_sum(batch)).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
            position = 0 if last else position + 1
    assert sum("gradients_set_to_none=False" in str(w.message) for w in caught) == 1
    assert firsts[0][1] < firsts[0][2]  # step 0 starts without gradients: the phase's prediction
    # Step 1 starts with them (the loop's first step is not looked at): planned anew from it (its
    # first microbatch, already fetched by the loader, carries the old figure; the calibration
    # reads the new one), the later as planned.
    assert sampler.planned_step(1).predicted_bytes[0] == outcome.model.predict(sampler.planned_step(1).dims[0])
    assert len(firsts) > 2 and all(predicted == steady for _, predicted, steady in firsts[2:])


class LstmLm(torch.nn.Module):
    """Tokens -> embedding 128 -> LSTM 256 -> next-token logits over LSTM_VOCAB: 5.4 MB of
    parameters (the embedding and the head most of it) beside small activations, so a step's
    first microbatch peaks late in its backward (every gradient allocated) when it is small and
    early (the activations) when it is large."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(LSTM_VOCAB, 128)
        self.lstm = torch.nn.LSTM(128, 256, batch_first=True)
        self.head = torch.nn.Linear(256, LSTM_VOCAB)

    def loss_sum(self, tokens):
        hidden, _ = self.lstm(self.embedding(tokens[:, :-1]))
        return torch.nn.functional.cross_entropy(self.head(hidden).reshape(-1, LSTM_VOCAB),
                                                 tokens[:, 1:].reshape(-1), reduction="sum")


LSTM_VOCAB = 2500


def test_a_first_microbatch_whose_peak_moves_from_the_gradients_to_the_activations_is_fitted_in_two_regimes():
    """The phase's fit takes max(F, F') of the model's formula where its held-out error is lower:
    small first microbatches peak at the gradients, large ones at the activations. Each step's
    first microbatch in training, from the third step, is then predicted within 1 % (the formula
    alone: -2.6 % to -2.1 % here without a calibration, -13.5 % to +1.4 % on a larger LSTM under
    accelerate)."""
    formula = xpm.CostFormula("a1*bs*l + a2*bs*l^2 + c", ["bs", "l"])
    torch.manual_seed(0)
    model = LstmLm()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lengths = np.random.default_rng(3).integers(4, 70, 640)
    texts = [torch.randint(1, LSTM_VOCAB, (int(n),)) for n in lengths]
    try:
        cap = METER.current_allocated_bytes + 40_000_000
        METER.capacity_bytes = cap
        outcome = xpm.probe(model, optimizer, lambda dims: model.loss_sum(random_lstm_tokens(dims)), formula,
                            meter=METER, variable_max={"bs": 64, "l": 70})
        phase = outcome.model.phase_report("without_gradients")
        assert phase["formula"]["canonical"].startswith("max(a1*bs*l + a2*bs*l^2 + c, "), phase
        assert set(phase["coefficients"]) == {"a1", "a2", "c", "a1_2", "a2_2", "c_2"}
        again = xpm.MemoryModel.from_json(outcome.model.to_json())  # the phase's formula travels with it
        for dims in ([1, 20], [4, 60], [30, 50]):
            assert again.predict(dims, "without_gradients", floor=False) == \
                outcome.model.predict(dims, "without_gradients", floor=False)
        sampler = xpm.PredictiveBatchSampler(lengths, outcome.model, xpm.MemoryBudget(cap).usable_bytes,
                                             outer_batch_size=64, seed=1, calibrate=False)
        firsts, position = [], 0
        for microbatch, weight, last in xpm.microbatch_loop(iter(sampler), sampler):
            batch = torch.zeros(len(microbatch), max(len(texts[i]) for i in microbatch), dtype=torch.long)
            for row, i in enumerate(microbatch):
                batch[row, :len(texts[i])] = texts[i]
            METER.reset_peak()
            (weight * model.loss_sum(batch)).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
            if position == 0 and not last and microbatch.step >= 2:
                firsts.append((microbatch.predicted_bytes - METER.peak_allocated_bytes) / METER.peak_allocated_bytes)
            position = 0 if last else position + 1
    finally:
        METER.capacity_bytes = 0
    assert len(firsts) >= 5 and max(map(abs, firsts)) < 0.01, firsts
    print(f"\nfirst microbatches from step 3: {100 * min(firsts):+.2f} % to {100 * max(firsts):+.2f} % "
          f"({len(firsts)}); phase formula {phase['formula']['canonical']}")


def random_lstm_tokens(dims):
    return torch.randint(1, LSTM_VOCAB, (int(dims[0]), int(dims[1])))


def test_two_regimes_of_a_formula_rename_the_second_pieces_coefficients_apart_from_every_name():
    from xpm.probing import _two_regimes
    two = _two_regimes(xpm.CostFormula("a*bs*l + c", ["bs", "l"]))
    assert two.canonical == "max(a*bs*l + c, a_2*bs*l + c_2)"
    assert list(two.coefficient_names) == ["a", "c", "a_2", "c_2"]
    other = _two_regimes(xpm.CostFormula("a*bs*l + a_2*bs + c", ["bs", "l"]))  # "_2" would repeat a name
    assert other.canonical == "max(a*bs*l + a_2*bs + c, a_2_3*bs + a_3*bs*l + c_3)"
    assert _two_regimes(xpm.CostFormula("max(a*bs*l + c, b*bs + d)", ["bs", "l"])) is None  # already in pieces


@pytest.mark.parametrize("formula, message", [
    ("a1*bs*l + c", "must be a formula's JSON object"),
    ({"text": "a1*bs*x + c", "coefficient_names": ["a1", "c"], "variable_names": ["bs", "x"]}, "must name the model's"),
    ({"text": "a1*bs*l + c", "coefficient_names": ["a1", "c"]}, "must name the model's variables ['bs', 'l']"),
    ({"text": "a1*bs*x + c", "coefficient_names": ["a1", "c"], "variable_names": ["bs", "l"]}, "does not parse over"),
])
def test_a_phase_formula_that_is_no_formula_of_the_model_is_refused_on_load_naming_it(trained, formula, message):
    parsed = json.loads(trained[0].model.to_json())
    parsed["metadata"]["phases"]["without_gradients"]["formula"] = formula
    with pytest.raises(ValueError) as error:
        xpm.MemoryModel.from_json(json.dumps(parsed))
    assert "metadata.phases['without_gradients'].formula" in str(error.value) and message in str(error.value)
    assert "\n" not in str(error.value)
