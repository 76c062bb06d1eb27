"""``PlannedTrainer`` as a drop-in for the real Hugging Face Trainer: no probe, sampler, lengths
or budget code from the user. The Trainer's own arguments set the outer batch
(``per_device_train_batch_size x gradient_accumulation_steps``), the dataset's records the dims,
the installed CPU meter's cap the budget; the trainer probes its own prepared step on its own
records, caches the fitted model, and checks how the model's loss is normalised.

Measured, not assumed: out-of-memory errors during training, records per optimizer step, each
microbatch's peak against its calibrated plan from the third step, the token count the Trainer
logs against the training microbatches' own, the accumulated gradient of an outer batch against
the same records run whole (a decoder-only Llama, padded and padding-free; a BART under
``Seq2SeqTrainer``, whose loss ignores ``num_items_in_batch``), and a second run from the cache.
"""
import gc
import importlib.util
import os
import pathlib

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import xpm  # noqa: E402
from xpm.integrations.hf_trainer import PlannedTrainer, planned_trainer_class  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[3]
DATA_DIR = pathlib.Path(os.environ.get("XPM_DATA_DIR", ROOT / "data" / "brown"))
CAP_BYTES = 24_000_000
PER_DEVICE, ACCUMULATION = 8, 4
OUTER = PER_DEVICE * ACCUMULATION


def _load_helpers():
    spec = importlib.util.spec_from_file_location("byte_llama", pathlib.Path(__file__).with_name("byte_llama.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


byte_llama = _load_helpers()


@pytest.fixture(scope="module")
def meter():
    """The process's CPU meter, installed before any model; each test builds its model uncapped,
    then caps it (the trainer finds the meter and its cap by itself)."""
    torch.set_num_threads(1)
    installed = xpm.CpuMeter.install()
    installed.capacity_bytes = 0
    return installed


@pytest.fixture(scope="module")
def sentences():
    if DATA_DIR.is_dir():
        return byte_llama.read_brown(DATA_DIR)[:2000]
    return byte_llama.generated_sentences(2000)


def _records(sentences):
    return [{"input_ids": list(s)} for s in sentences]


def _arguments(output_dir, arguments_class=None, **extra):
    options = dict(output_dir=str(output_dir), learning_rate=2e-3, per_device_train_batch_size=PER_DEVICE,
                   gradient_accumulation_steps=ACCUMULATION, lr_scheduler_type="constant", max_grad_norm=0.0,
                   logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                   dataloader_pin_memory=False, seed=1)
    options.update(extra)
    return (arguments_class or transformers.TrainingArguments)(**options)


class _Gradients(transformers.TrainerCallback):
    """Each optimizer step's gradients, by global step (numpy copies: outside the meter)."""

    def __init__(self):
        self.by_step = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.by_step[state.global_step + 1] = [p.grad.detach().numpy().copy() for p in model.parameters()]


def _training_ooms(meter, before, trainer):
    probes = trainer.xpm_memory.outcome.probes if trainer.xpm_memory.outcome is not None else []
    return meter.oom_count - before - sum(not p.feasible for p in probes)


def _records_by_step(measured):
    steps = {}
    for record in measured:
        steps.setdefault(record.step, []).append(list(record.records))
    return steps


def _assert_gradients_equal(planned, whole, names):
    worst = 0.0
    for name, a, b in zip(names, planned, whole):
        scale = max(1e-6, float(np.abs(b).max()))
        difference = float(np.abs(a - b).max())
        assert difference <= 1e-5 * scale + 1e-7, f"{name}: max difference {difference:.3e} of {scale:.3e}"
        worst = max(worst, difference / scale)
    return worst


def _whole_batch_gradients(model_builder, collate, records, meter):
    """The gradients of ``records`` run as one batch through a fresh copy of the model (uncapped)."""
    capacity, meter.capacity_bytes = meter.capacity_bytes, 0
    try:
        model = model_builder()
        model.train()
        model(**collate(records)).loss.backward()
        return [p.grad.detach().numpy().copy() for p in model.parameters()]
    finally:
        meter.capacity_bytes = capacity


def _capped_model(meter, builder):
    meter.capacity_bytes = 0
    gc.collect()
    model = builder()
    meter.capacity_bytes = CAP_BYTES
    return model


def test_drop_in_trains_the_users_arguments_under_the_cap_and_caches_its_model(meter, sentences, tmp_path):
    measured, records = [], _records(sentences)
    model = _capped_model(meter, byte_llama.build_model)
    trainer = PlannedTrainer(model=model, args=_arguments(tmp_path, max_steps=6, include_num_input_tokens_seen=True),
                             train_dataset=records, data_collator=byte_llama.pad_collate,
                             on_microbatch=measured.append)
    before = meter.oom_count
    trainer.train()
    print(f"\n{trainer.xpm_report}")
    assert _training_ooms(meter, before, trainer) == 0
    steps = _records_by_step(measured)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert all(sum(len(m) for m in microbatches) == OUTER for microbatches in steps.values())
    assert max(len(m) for m in steps.values()) > 1, "the cap should split an outer batch"
    assert f"{OUTER} records per optimizer step" in trainer.xpm_report and "probes" in trainer.xpm_report
    # Probes leave no trace: the Trainer counted the training microbatches' tokens alone.
    lengths = np.array([len(s) for s in sentences])
    tokens = sum(len(r.records) * int(lengths[list(r.records)].max()) for r in measured)
    assert trainer.state.num_input_tokens_seen == tokens
    # From the third step, every microbatch above half the budget within -1 % / +3 % of its peak.
    usable = trainer.xpm_memory.usable_bytes
    errors = [(r.predicted_bytes + r.correction_bytes - r.peak_allocated_bytes) / r.peak_allocated_bytes
              for r in measured if r.step >= 3 and r.peak_allocated_bytes > usable / 2]
    print(f"planned vs measured from step 3 ({len(errors)} microbatches above half the budget): "
          f"{100 * min(errors):+.2f} % to {100 * max(errors):+.2f} %")
    assert errors and -0.01 <= min(errors) and max(errors) <= 0.03
    cached = list((tmp_path / "xpm-memory-models").glob("memory-model-*.json"))
    assert len(cached) == 1

    # The same job again: the model comes from the cache, nothing is probed.
    del trainer, model
    model = _capped_model(meter, byte_llama.build_model)
    again = PlannedTrainer(model=model, args=_arguments(tmp_path, max_steps=2), train_dataset=records,
                           data_collator=byte_llama.pad_collate)
    before = meter.oom_count
    again.train()
    assert again.xpm_memory.outcome is None and "from the cache" in again.xpm_report
    assert meter.oom_count == before


def test_drop_in_accumulates_an_outer_batch_exactly(meter, sentences, tmp_path):
    measured, gradients, records = [], _Gradients(), _records(sentences)
    model = _capped_model(meter, byte_llama.build_model)
    trainer = PlannedTrainer(model=model, args=_arguments(tmp_path, max_steps=1), train_dataset=records,
                             data_collator=byte_llama.pad_collate, on_microbatch=measured.append,
                             callbacks=[gradients], cache_dir=False)
    trainer.train()
    step = [i for r in measured for i in r.records]
    assert len(measured) > 1 and len(step) == OUTER
    whole = _whole_batch_gradients(byte_llama.build_model, byte_llama.pad_collate, [records[i] for i in step], meter)
    names = [name for name, _ in trainer.model.named_parameters()]
    worst = _assert_gradients_equal(gradients.by_step[1], whole, names)
    print(f"\n{len(measured)} microbatches of {OUTER} records: max gradient difference {worst:.2e} of the largest")


def test_padding_free_collator_is_planned_by_the_tokens_a_microbatch_holds(meter, sentences, tmp_path):
    """``DataCollatorWithFlattening``: each microbatch is planned by its summed tokens (``t``),
    never records x longest. (Its gradient is not compared with the whole batch's: under sdpa the
    Llama of transformers 5.17 attends across the flattened records' boundaries, so a flattened
    batch's loss depends on which records share it, with or without xpm.)"""
    collator = transformers.DataCollatorWithFlattening()
    measured, records = [], _records(sentences)
    model = _capped_model(meter, byte_llama.build_model)
    trainer = PlannedTrainer(model=model, args=_arguments(tmp_path, max_steps=6), train_dataset=records,
                             data_collator=collator, on_microbatch=measured.append, cache_dir=False)
    before = meter.oom_count
    trainer.train()
    print(f"\n{trainer.xpm_report}")
    assert trainer.xpm_report.startswith("xpm: padding_free records")
    assert list(trainer.xpm_memory.model.formula.variable_names) == ["bs", "t"]
    assert _training_ooms(meter, before, trainer) == 0
    lengths = np.array([len(s) for s in sentences])
    model_of = trainer.xpm_memory.model
    for record in measured:  # a step's first microbatch runs without gradients, the others with them
        dims = [len(record.records), int(lengths[list(record.records)].sum())]
        assert any(record.predicted_bytes == pytest.approx(float(model_of.predict(dims, phase)))
                   for phase in model_of.phases)
    usable = trainer.xpm_memory.usable_bytes
    errors = [(r.predicted_bytes + r.correction_bytes - r.peak_allocated_bytes) / r.peak_allocated_bytes
              for r in measured if r.step >= 3 and r.peak_allocated_bytes > usable / 2]
    print(f"planned vs measured from step 3 ({len(errors)} microbatches above half the budget): "
          f"{100 * min(errors):+.2f} % to {100 * max(errors):+.2f} %")
    assert errors and -0.01 <= min(errors) and max(errors) <= 0.03


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=260, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=160,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return BartForConditionalGeneration(config).float()


def _seq2seq_collate(records):
    """Sources padded with the pad id 1 and a mask, targets padded with -100."""
    pad = torch.nn.utils.rnn.pad_sequence
    sources = [torch.tensor(r["input_ids"]) for r in records]
    targets = [torch.tensor(r["labels"]) for r in records]
    mask = pad([torch.ones(len(s), dtype=torch.long) for s in sources], batch_first=True)
    return {"input_ids": pad(sources, batch_first=True, padding_value=1), "attention_mask": mask,
            "labels": pad(targets, batch_first=True, padding_value=-100)}


def test_seq2seq_bart_whose_loss_ignores_num_items_accumulates_exactly(meter, sentences, tmp_path, caplog):
    """BART's ``forward`` takes ``**kwargs``, so the Trainer passes ``num_items_in_batch``, but its
    loss is a plain mean: the check finds it, and the microbatch losses are weighted instead."""
    records = [{"input_ids": [b + 3 for b in sentences[i][:120]], "labels": [b + 3 for b in sentences[i + 1][:80]]}
               for i in range(len(sentences) - 1)]
    measured, gradients = [], _Gradients()
    model = _capped_model(meter, _bart)
    trainer_class = planned_trainer_class(transformers.Seq2SeqTrainer)
    trainer = trainer_class(model=model, args=_arguments(tmp_path, transformers.Seq2SeqTrainingArguments, max_steps=3),
                            train_dataset=records, data_collator=_seq2seq_collate, on_microbatch=measured.append,
                            callbacks=[gradients], cache_dir=False,
                            probe_options=xpm.ProbeOptions(usable_max_rel_error=0.10, adaptive_max_probes=0))
    assert trainer.model_accepts_loss_kwargs  # what transformers decided from the signature
    before = meter.oom_count
    with caplog.at_level("WARNING", logger="xpm"):
        trainer.train()
    print(f"\n{trainer.xpm_report}")
    assert not trainer.model_accepts_loss_kwargs
    assert any("ignores num_items_in_batch" in r.getMessage() for r in caplog.records)
    assert trainer.xpm_report.startswith("xpm: encoder_decoder records")
    assert list(trainer.xpm_memory.model.formula.variable_names) == ["bs", "ls", "lt"]
    assert _training_ooms(meter, before, trainer) == 0
    step = [i for r in measured if r.step == 1 for i in r.records]
    assert len([r for r in measured if r.step == 1]) > 1
    whole = _whole_batch_gradients(_bart, _seq2seq_collate, [records[i] for i in step], meter)
    names = [name for name, _ in trainer.model.named_parameters()]
    worst = _assert_gradients_equal(gradients.by_step[1], whole, names)
    print(f"BART: max gradient difference {worst:.2e} of the largest")


def test_what_cannot_be_planned_is_refused_at_construction(meter, sentences, tmp_path):
    records = _records(sentences[:100])
    model = _capped_model(meter, byte_llama.build_model)
    meter.capacity_bytes = 0
    with pytest.raises(ValueError, match=r"^PlannedTrainer: training on the CPU but the xpm.CpuMeter has no cap"):
        PlannedTrainer(model=model, args=_arguments(tmp_path), train_dataset=records,
                       data_collator=byte_llama.pad_collate)
    meter.capacity_bytes = CAP_BYTES

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(records)

    with pytest.raises(ValueError, match=r"^PlannedTrainer: train_dataset must be map-style"):
        PlannedTrainer(model=model, args=_arguments(tmp_path, max_steps=1), train_dataset=Stream(),
                       data_collator=byte_llama.pad_collate)
    with pytest.raises(ValueError, match=r"^PlannedTrainer: formula variables \['bs', 'n'\] are not this trainer's"):
        PlannedTrainer(model=model, args=_arguments(tmp_path), train_dataset=records,
                       data_collator=byte_llama.pad_collate, formula=xpm.CostFormula("a*bs*n + c", ["bs", "n"]))
    with pytest.raises(ValueError, match=r"^PlannedTrainer: memory_fraction must be in \(0, 1\], got 1.5"):
        PlannedTrainer(model=model, args=_arguments(tmp_path), train_dataset=records,
                       data_collator=byte_llama.pad_collate, memory_fraction=1.5)
