"""xpm under the real Lightning Trainer with ``strategy="ddp", devices=2`` on CPU.

Lightning's DDP launcher starts the second rank by running the script again, so the training runs
in a script of its own (written below into the test's temporary folder) and every rank writes
what it saw to a JSON file: the record indices of every microbatch of every step, the optimizer
steps, the gradient all-reduces (a counting DDP communication hook) per microbatch, OOMs under
the CPU cap, the memory model's prediction errors, and the all-reduced gradient of two steps
against the outer batch's mean-loss gradient computed in one batch.

Data: Brown sentences when data/brown holds the corpus, else generated sentences of varied
lengths.
"""
import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")
import xpm  # noqa: E402

METER = xpm.CpuMeter.install()  # before any model of this process: the meter must see the weights
import lightning  # noqa: E402

from xpm.integrations import lightning as xpm_lightning  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__` defined")  # sharded itself
REPO = pathlib.Path(__file__).resolve().parents[3]
RECORDS = 32 * 6 + 1  # the last outer batch holds one record: one rank's share of it is empty
OUTER_BATCH = 32
EPOCHS = 2

WORKER = textwrap.dedent(r'''
    """One rank of a Lightning DDP run with xpm's planning; writes rank<r>.json into argv[1]."""
    import copy
    import json
    import pathlib
    import random
    import re
    import sys
    import warnings

    import numpy as np
    import torch

    torch.set_num_threads(1)
    import xpm

    meter = xpm.CpuMeter.install()  # before any model is built
    import lightning
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from xpm.integrations import lightning as xpm_lightning

    OUT, MODE, DATA_DIR = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
    RECORDS, OUTER_BATCH, EPOCHS = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    CAP, MAX_CHARS, VOCAB = 8_000_000, 160, 128
    warnings.filterwarnings("ignore", ".*IterableDataset. has .__len__. defined.*")


    def sentences():
        files = sorted(p for p in DATA_DIR.glob("c[a-r][0-9][0-9]")) if DATA_DIR.is_dir() else []
        texts = []
        for path in files:
            for line in path.read_text().splitlines():
                text = " ".join(token.rsplit("/", 1)[0] for token in line.split())
                if len(text) >= 5:
                    texts.append(text[:MAX_CHARS])
        if len(texts) >= RECORDS:
            return texts[:RECORDS], "brown"
        rng = random.Random(7)  # generated like Brown's: words of 1-9 letters, 3-50 words a sentence
        words = ["".join(rng.choice("etaoinshrdlucmfwyp") for _ in range(rng.randint(1, 9))) for _ in range(300)]
        return [" ".join(rng.choice(words) for _ in range(min(50, 3 + int(rng.expovariate(1 / 18)))))[:MAX_CHARS]
                for _ in range(RECORDS)], "generated"


    def collate(texts):
        chars = torch.zeros(len(texts), max(len(t) for t in texts), dtype=torch.long)
        for row, text in enumerate(texts):
            chars[row, :len(text)] = torch.tensor([ord(c) & 127 or 1 for c in text])
        return {"chars": chars, "units": float(sum(len(t) - 1 for t in texts))}


    class CharTransformer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Embedding(VOCAB, 32)
            self.position = torch.nn.Embedding(MAX_CHARS, 32)
            layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = torch.nn.Linear(32, VOCAB)

        def loss_sum(self, chars):
            inputs, targets = chars[:, :-1], chars[:, 1:]
            l = inputs.size(1)
            x = self.embedding(inputs) + self.position(torch.arange(l))
            causal = torch.ones(l, l, dtype=torch.bool).triu(1)  # True: not attended
            hidden = self.encoder(x, mask=causal, src_key_padding_mask=inputs.eq(0))
            return torch.nn.functional.cross_entropy(self.head(hidden).reshape(-1, VOCAB), targets.reshape(-1),
                                                     ignore_index=0, reduction="sum")


    class Recorder(lightning.LightningModule):
        def __init__(self, texts):
            super().__init__()
            self.automatic_optimization = False
            self.net = CharTransformer()
            self.texts, self.lengths = texts, np.array([len(t) for t in texts])
            self.seen = {"steps": [], "optimizer_steps": 0, "ooms": 0, "max_abs_error": 0.0, "worst_under": 0.0,
                         "measured": 0, "allreduces": [], "gradient_checks": [], "calibrated": []}
            self.hook_calls = 0

        def configure_optimizers(self):
            return torch.optim.AdamW(self.net.parameters(), lr=1e-3)

        def on_fit_start(self):
            # DDP has wrapped the module (its gradient buckets allocated) and the optimizer is
            # built: every rank probes in lockstep, the buckets in the probes, the same model.
            torch.manual_seed(1)
            meter.capacity_bytes = CAP
            outcome = xpm.probe(
                self.net, self.trainer.optimizers[0],
                lambda dims: self.net.loss_sum(torch.randint(1, VOCAB, (int(dims[0]), int(dims[1])))),
                xpm.CostFormula("a*bs*l^2 + b*bs*l + d*bs + c", ["bs", "l"]), meter=meter,
                variable_max={"bs": OUTER_BATCH, "l": int(self.lengths.max())}, design_fractions=(1.0, 0.5, 0.25),
                lockstep=True)
            self.memory_model = outcome.model
            self.seen["outside"] = [part.kind for part in outcome.outside_probes]
            self.reserve = 0  # nothing to reserve: the probes saw the buckets
            self.usable = xpm.MemoryBudget(CAP).usable_bytes
            self.seen["model_json"] = self.memory_model.to_json()
            self.sampler = xpm.PredictiveBatchSampler(self.lengths, self.memory_model, self.usable,
                                                      outer_batch_size=OUTER_BATCH, seed=3, units=self.lengths - 1,
                                                      rank=torch.distributed.get_rank(),
                                                      world_size=torch.distributed.get_world_size())

        def train_dataloader(self):
            if MODE == "stepdataset":  # the map-style adapter, as Lightning re-shards it under DDP
                return torch.utils.data.DataLoader(xpm.StepDataset(self.texts, self.sampler, collate), batch_size=None)
            if MODE == "plain":  # what Lightning's own error about batch samplers leads a user to
                return torch.utils.data.DataLoader(self.texts, batch_sampler=self.sampler, collate_fn=collate)
            return xpm_lightning.planned_dataloader(self.trainer, self.texts, self.sampler, collate)

        def on_train_start(self):
            def counting_allreduce(state, bucket):
                self.hook_calls += 1
                return allreduce_hook(None, bucket)
            self.trainer.strategy.model.register_comm_hook(None, counting_allreduce)

        def mean_loss(self, batch):
            return self.net.loss_sum(batch["chars"]) / batch["units"]

        def training_step(self, step, index):
            calls, step_start = [], self.hook_calls

            for k, (batch, weight, last) in enumerate(xpm_lightning.microbatches(self, step, sampler=self.sampler,
                                                                                  meter=meter)):
                before = self.hook_calls
                meter.reset_peak()
                try:
                    self.manual_backward(weight * self.mean_loss(batch))
                except RuntimeError as error:
                    if "out of memory" in str(error).lower():
                        self.seen["ooms"] += 1
                    raise
                measured = meter.peak_allocated_bytes
                predicted = self.memory_model.predict(list(batch["chars"].shape)) + self.reserve
                if measured > self.memory_model.floor_bytes:
                    relative = (predicted - measured) / measured
                    self.seen["measured"] += 1
                    self.seen["max_abs_error"] = max(self.seen["max_abs_error"], abs(relative))
                    self.seen["worst_under"] = min(self.seen["worst_under"], relative)
                    planned = step.predicted_bytes[k] + step.correction_bytes[k]  # what the calibrated plan fits
                    self.seen["calibrated"].append([self.seen["optimizer_steps"], (planned - measured) / measured])
                calls.append(self.hook_calls - before)
            if not step.batches:  # the zero loss's backward ran inside microbatches()
                calls.append(self.hook_calls - step_start)
            self.seen["steps"].append({"epoch": step.epoch, "index": step.index, "batch_idx": index,
                                       "lightning_epoch": self.current_epoch, "indices": step.indices})
            self.seen["allreduces"].append(calls)
            if step.epoch == 0 and step.index in (0, self.sampler.steps_per_epoch() - 1):
                self.seen["gradient_checks"].append(self.gradient_check(step))
            optimizer = self.optimizers()
            optimizer.step()
            optimizer.zero_grad()
            self.seen["optimizer_steps"] += 1

        def gradient_check(self, step):
            """The all-reduced gradient against the outer batch's mean-loss gradient in one batch."""
            shares = [None] * torch.distributed.get_world_size()  # every rank's records of this step
            torch.distributed.all_gather_object(shares, [i for microbatch in step.indices for i in microbatch])
            records = [i for share in shares for i in share]
            capacity, meter.capacity_bytes = meter.capacity_bytes, 0
            reference = copy.deepcopy(self.net)
            reference.zero_grad(set_to_none=True)
            batch = collate([self.texts[i] for i in records])
            (reference.loss_sum(batch["chars"]) / batch["units"]).backward()
            meter.capacity_bytes = capacity
            worst = 0.0
            for mine, theirs in zip(self.net.parameters(), reference.parameters()):
                scale = float(theirs.grad.abs().max()) + 1e-12
                worst = max(worst, float((mine.grad - theirs.grad).abs().max()) / scale)
            return {"index": step.index, "records": sorted(records), "max_rel_diff": worst,
                    "empty_share": not step.batches}


    if __name__ == "__main__":
        texts, source = sentences()
        module = Recorder(texts)
        trainer = lightning.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_epochs=EPOCHS, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, use_distributed_sampler=MODE != "plain")
        try:
            trainer.fit(module)
        except Exception as error:  # written down for the test, then the run fails
            module.seen["error"] = f"{type(error).__name__}: {error}"
        module.seen.update(rank=trainer.global_rank, world_size=trainer.world_size, source=source,
                           steps_per_epoch=module.sampler.steps_per_epoch() if hasattr(module, "sampler") else None)
        (OUT / f"rank{trainer.global_rank}.json").write_text(json.dumps(module.seen))
        sys.exit(1 if "error" in module.seen else 0)
''')


def _run_ranks(tmp_path: pathlib.Path, mode: str, timeout_s: float) -> list:
    """Runs the worker (Lightning starts rank 1 itself); returns both ranks' JSON."""
    script = tmp_path / "lightning_ddp_worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.pop("LOCAL_RANK", None)
    env.pop("WORLD_SIZE", None)
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path), mode, str(REPO / "data" / "brown"),
                                str(RECORDS), str(OUTER_BATCH), str(EPOCHS)], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the run's own session: both ranks
        output, _ = process.communicate()
        pytest.fail(f"the DDP run did not finish in {timeout_s} s (a hang?):\n{output.decode()[-3000:]}")
    files = [tmp_path / f"rank{r}.json" for r in range(2)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"ranks wrote no result {missing}; exit {process.returncode}:\n{output.decode()[-3000:]}"
    return [json.loads(f.read_text()) for f in files], process.returncode, output.decode()


def test_ddp_two_ranks_every_record_once_one_allreduce_per_step(tmp_path):
    start = time.perf_counter()
    ranks, code, output = _run_ranks(tmp_path, "planned", timeout_s=100)
    for seen in ranks:
        assert "error" not in seen, seen["error"]
    assert code == 0, output[-3000:]
    assert [seen["rank"] for seen in ranks] == [0, 1] and {seen["world_size"] for seen in ranks} == {2}
    # The plans are the same on both ranks: both probed the wrapped step in lockstep.
    # The probed net sits inside the LightningModule DDP wraps: its buckets are in the probes,
    # and nothing is reported outside them.
    assert [seen["outside"] for seen in ranks] == [[], []]
    models = [json.loads(seen["model_json"]) for seen in ranks]
    assert [m["coefficients"] for m in models] == [models[0]["coefficients"]] * 2
    assert models[0]["metadata"]["phases"] == models[1]["metadata"]["phases"]

    steps_per_epoch = ranks[0]["steps_per_epoch"]
    assert steps_per_epoch == -(-RECORDS // OUTER_BATCH)
    # The same number of optimizer steps on both ranks, one per outer batch.
    assert [seen["optimizer_steps"] for seen in ranks] == [EPOCHS * steps_per_epoch] * 2
    # Every record exactly once per epoch across both ranks; each epoch its own permutation.
    orders = []
    for epoch in range(EPOCHS):
        seen_indices = []
        for seen in ranks:
            steps = [s for s in seen["steps"] if s["epoch"] == epoch]
            assert [s["index"] for s in steps] == list(range(steps_per_epoch))
            assert all(s["batch_idx"] == s["index"] and s["lightning_epoch"] == epoch for s in steps)
            seen_indices += [i for s in steps for microbatch in s["indices"] for i in microbatch]
        assert sorted(seen_indices) == list(range(RECORDS)), f"epoch {epoch}: records missing or repeated"
        orders.append([i for s in ranks[0]["steps"] if s["epoch"] == epoch for mb in s["indices"] for i in mb])
    assert orders[0] != orders[1], "both epochs had the same permutation (set_epoch not applied)"

    # Several microbatches per outer batch under the cap, and no OOM.
    microbatches = sum(len(s["indices"]) for seen in ranks for s in seen["steps"])
    assert microbatches >= 2 * EPOCHS * steps_per_epoch * 2 - 2, f"only {microbatches} microbatches"
    assert [seen["ooms"] for seen in ranks] == [0, 0]
    assert all(seen["measured"] > 0 for seen in ranks)
    # Measured peaks against the model's prediction plus DDP's buckets (what the budget reserves):
    # under by at most half the budget's 10 % margin; over by more at the first step (no optimizer
    # state yet) and at small microbatches, which costs nothing but a smaller microbatch.
    assert min(seen["worst_under"] for seen in ranks) > -0.05
    assert max(seen["max_abs_error"] for seen in ranks) < 0.25

    # The calibration (microbatches(..., sampler=, meter=)): from the third optimizer step on, no
    # microbatch above the floor is under-predicted by more than 1 % of what its plan fits, nor
    # over-predicted by more than 3 % (each step's first microbatch predicted without gradients).
    calibrated = [error for seen in ranks for step, error in seen["calibrated"] if step >= 2]
    assert calibrated and min(calibrated) > -0.01, f"under-predicted by {-100 * min(calibrated):.2f} %"
    assert max(calibrated) < 0.03, f"over-predicted by {100 * max(calibrated):.2f} %"

    # Gradients all-reduced once per step on every rank, at its last microbatch only.
    assert [len(seen["allreduces"]) for seen in ranks] == [EPOCHS * steps_per_epoch] * 2
    per_step = [[sum(calls) for calls in seen["allreduces"]] for seen in ranks]
    assert per_step[0] == per_step[1] and min(per_step[0]) >= 1
    for seen in ranks:
        for calls in seen["allreduces"]:
            assert all(c == 0 for c in calls[:-1]) and calls[-1] >= 1, f"all-reduces per microbatch: {calls}"

    # The all-reduced gradient is the outer batch's mean-loss gradient (first and last step of
    # epoch 0; in the last, one rank's share is empty and it backwards the zero loss).
    checks = [check for seen in ranks for check in seen["gradient_checks"]]
    assert len(checks) == 4 and sum(check["empty_share"] for check in checks) == 1
    assert max(check["max_rel_diff"] for check in checks) < 1e-4, checks
    print(f"\nlightning ddp: {ranks[0]['source']} records {RECORDS}, {EPOCHS} epochs x {steps_per_epoch} steps, "
          f"{microbatches} microbatches, all-reduces/step {per_step[0][0]}, OOM 0, max |prediction error| "
          f"{100 * max(s['max_abs_error'] for s in ranks):.2f} %, calibrated from step 3 "
          f"{100 * min(calibrated):+.2f} % to {100 * max(calibrated):+.2f} %, gradient rel diff "
          f"{max(c['max_rel_diff'] for c in checks):.1e}, {time.perf_counter() - start:.0f} s")


def test_ddp_map_style_step_dataset_is_refused_with_the_fix(tmp_path):
    # With use_distributed_sampler=True (the default), Lightning puts a DistributedSampler on a
    # map-style xpm.StepDataset loader; the first training step refuses its items.
    ranks, code, output = _run_ranks(tmp_path, "stepdataset", timeout_s=100)
    assert code != 0
    for seen in ranks:
        assert seen["error"].startswith("TypeError: xpm: training_step got a list, not a PlannedStep"), seen["error"]
        assert "use_distributed_sampler=False" in seen["error"] and "\n" not in seen["error"]
        assert seen["optimizer_steps"] == 0


def test_ddp_plain_dataloader_over_the_sampler_stops_every_rank_in_one_line(tmp_path):
    # DataLoader(batch_sampler=sampler) with use_distributed_sampler=False: Lightning would step
    # once per microbatch, weights ignored; every rank refuses it before its first step.
    start = time.perf_counter()
    ranks, code, output = _run_ranks(tmp_path, "plain", timeout_s=100)
    assert code != 0
    for seen in ranks:
        assert seen["error"].startswith("ValueError: xpm: Lightning's training loop iterates a DataLoader over "
                                        "PredictiveBatchSampler"), seen["error"]
        assert "planned_dataloader" in seen["error"] and "\n" not in seen["error"]
        assert seen["optimizer_steps"] == 0
    print(f"\nlightning plain DataLoader: both ranks stopped in {time.perf_counter() - start:.0f} s, probe included")


# ---- one process, one device: the same recipe without DDP, and its errors

class BigramModule(lightning.LightningModule):
    """Next character from the current one (embedding 16 -> 128 logits); memory grows with bs*l."""

    def __init__(self, texts, sampler_world_size=None, automatic=False):
        super().__init__()
        self.automatic_optimization = automatic
        self.embedding = torch.nn.Embedding(128, 16)
        self.head = torch.nn.Linear(16, 128)
        self.texts, self.lengths = texts, np.array([len(t) for t in texts])
        self.sampler_world_size = sampler_world_size
        self.steps_seen = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def loss_sum(self, chars):
        logits = self.head(self.embedding(chars[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 128), chars[:, 1:].reshape(-1), ignore_index=0,
                                                 reduction="sum")

    def setup(self, stage):
        METER.capacity_bytes = 3_000_000
        model = xpm_lightning.probe_and_share(
            self, self.configure_optimizers(), lambda dims: self.loss_sum(torch.randint(1, 128, (int(dims[0]), int(dims[1])))),
            xpm.CostFormula("a*bs*l + b*bs + c", ["bs", "l"]), meter=METER,
            variable_max={"bs": 16, "l": int(self.lengths.max())}, design_fractions=(1.0, 0.5))
        world = self.sampler_world_size or self.trainer.world_size
        self.sampler = xpm.PredictiveBatchSampler(self.lengths, model, xpm.MemoryBudget(3_000_000).usable_bytes,
                                                  outer_batch_size=16, rank=0, world_size=world, seed=5,
                                                  units=self.lengths - 1)

    def teardown(self, stage):
        METER.capacity_bytes = 0

    def train_dataloader(self):
        return xpm_lightning.planned_dataloader(self.trainer, self.texts, self.sampler, _collate)

    def mean_loss(self, batch):
        return self.loss_sum(batch["chars"]) / batch["units"]

    def training_step(self, step, index):
        loss = xpm_lightning.backward_microbatches(self, step, self.mean_loss)
        self.steps_seen.append((step.epoch, step.index, step.indices))
        self.optimizers().step()
        self.optimizers().zero_grad()
        return loss


def _collate(texts):
    chars = torch.zeros(len(texts), max(len(t) for t in texts), dtype=torch.long)
    for row, text in enumerate(texts):
        chars[row, :len(text)] = torch.tensor([ord(c) & 127 or 1 for c in text])
    return {"chars": chars, "units": float(sum(len(t) - 1 for t in texts))}


def _texts(n=70):
    rng = np.random.default_rng(11)
    return ["".join(rng.choice(list("abcdefgh ")) for _ in range(int(k))) for k in rng.integers(5, 160, n)]


def _trainer(epochs=2):
    return lightning.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)


def test_single_device_every_record_once_per_epoch_several_microbatches():
    torch.manual_seed(2)
    texts = _texts()
    module = BigramModule(texts)
    trainer = _trainer()
    trainer.fit(module)
    steps_per_epoch = module.sampler.steps_per_epoch()
    assert trainer.global_step == 2 * steps_per_epoch  # one optimizer step per outer batch
    assert [(e, k) for e, k, _ in module.steps_seen] == [(e, k) for e in range(2) for k in range(steps_per_epoch)]
    orders = [[i for e, _, indices in module.steps_seen if e == epoch for mb in indices for i in mb] for epoch in (0, 1)]
    assert all(sorted(order) == list(range(len(texts))) for order in orders) and orders[0] != orders[1]
    assert sum(len(indices) for _, _, indices in module.steps_seen) > len(module.steps_seen)  # several microbatches


def test_errors_name_the_fix():
    texts = _texts(20)
    with pytest.raises(ValueError, match="automatic_optimization = False"):
        _trainer(1).fit(BigramModule(texts, automatic=True))
    with pytest.raises(ValueError, match="rank 0 of world size 2 but this process is rank 0 of 1"):
        _trainer(1).fit(BigramModule(texts, sampler_world_size=2))
    with pytest.raises(ValueError, match="batch_size cannot be given"):
        xpm_lightning.planned_dataloader(_trainer(1), texts, None, _collate, batch_size=4)
    # The one callback's arguments, refused when it is built (not after probing).
    for keywords, expected in (({"formula": "a*bs*l + c"}, "formula must be 'auto' or an xpm.CostFormula, got "
                                                           "'a*bs*l + c'"),
                               ({"units": 3}, "units must be a function of a record (or None), got 3"),
                               ({"record_dims": [1, 2]}, "record_dims must be a function of a record"),
                               ({"packer": "FFD"}, "packer must be 'adaptive', 'fastest', 'ffd' or 'uniform', "
                                                   "got 'FFD'"),
                               ({"seed": -1}, "seed must be a whole number >= 0"),
                               ({"seed": "3"}, "seed must be a whole number, got '3'"),
                               ({"formula": xpm.CostFormula("a*bs + c", ["bs"])},
                                "the formula's variables ['bs'] are 1, but without record_dims= each record's dims "
                                "are 2 (bs, l): give record_dims="),
                               ({"formula": xpm.CostFormula("a*n*t + c", ["n", "t"])},
                                "the formula's variables ['n', 't'] are not the names of the records' dims read "
                                "without record_dims= (bs, l)")):
        with pytest.raises(ValueError) as caught:
            xpm_lightning.PlannedMicrobatches(**keywords)
        assert str(caught.value).startswith(f"PlannedMicrobatches: {expected}"), caught.value


def test_workers_collate_the_same_steps_in_the_same_order():
    texts = _texts(50)
    module = BigramModule(texts, sampler_world_size=1)
    module.setup("fit")
    try:
        trainer = _trainer(1)
        runs = [[(s.epoch, s.index, s.indices, [b["chars"].shape for b, _ in s.batches], [w for _, w in s.batches])
                 for s in xpm_lightning.planned_dataloader(trainer, texts, module.sampler, _collate, num_workers=workers)]
                for workers in (0, 2)]
    finally:
        METER.capacity_bytes = 0
    assert runs[0] == runs[1] and len(runs[0]) == module.sampler.steps_per_epoch()


def test_both_integrations_yield_xpm_planned_step_with_lightnings_earlier_fields(monkeypatch):
    """One step type: the HF Trainer's and Lightning's loaders yield ``xpm.PlannedStep``, whose
    ``batches``, ``indices`` and ``record_count`` (Lightning's earlier fields) follow its
    ``microbatches``, ``records`` and ``weights``; Lightning's batch transfer hands it on as it is
    (no collection, unlike a dataclass), and it pickles for DataLoader workers."""
    pytest.importorskip("transformers")
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from xpm.integrations import hf_trainer

    assert hf_trainer.PlannedStep is xpm_lightning.PlannedStep is xpm.PlannedStep
    texts = _texts(50)
    module = BigramModule(texts, sampler_world_size=1)
    module.setup("fit")
    try:
        steps = list(xpm_lightning.planned_dataloader(_trainer(1), texts, module.sampler, _collate))
        module.sampler.set_epoch(0)
        planned = [[tuple(m.tolist()) for m in step.microbatches if len(m)] for step in module.sampler.steps()]
    finally:
        METER.capacity_bytes = 0
    assert [step.records for step in steps] == planned and any(len(step) > 1 for step in steps)
    for step in steps:
        assert type(step) is xpm.PlannedStep and (step.rank, step.world_size, step.placeholder) == (0, 1, False)
        assert [(id(b), w) for b, w in step.batches] == [(id(b), w) for b, w in zip(step.microbatches, step.weights)]
        assert step.indices == [list(r) for r in step.records] and len(step) == len(step.microbatches)
        rows = sum(b["chars"].shape[0] for b in step.microbatches)
        assert step.record_count == sum(len(r) for r in step.records) == rows
        assert len(step.predicted_bytes) == len(step.correction_bytes) == len(step)
        assert move_data_to_device(step, torch.device("cpu")) is step
        again = pickle.loads(pickle.dumps(step))
        assert (again.epoch, again.index, again.records, again.weights, again.predicted_bytes) == \
            (step.epoch, step.index, step.records, step.weights, step.predicted_bytes)
        assert all(torch.equal(a["chars"], b["chars"]) for a, b in zip(again.microbatches, step.microbatches))
    assert repr(steps[0]).startswith("PlannedStep(epoch=0, index=0, rank=0/1, microbatches=")
    assert "tensor" not in repr(steps[0])
    empty = xpm.PlannedStep(0, 3, 1, 2, [], [], [])  # Lightning's empty share: no microbatch
    assert (empty.batches, empty.indices, empty.record_count, len(empty)) == ([], [], 0, 0)
    stand_in = xpm.PlannedStep(0, 3, 1, 2, [{"chars": torch.zeros(1, 3)}], [(0,)], [0.0], placeholder=True)
    assert stand_in.record_count == 0 and stand_in.indices == [[0]] and "placeholder" in repr(stand_in)
    monkeypatch.setattr("torch.utils.data._utils.pin_memory.pin_memory", lambda batch: ("pinned", batch))
    first = steps[0].microbatches[0]
    assert steps[0].pin_memory() is steps[0] and steps[0].batches[0][0] == ("pinned", first)
    with pytest.raises(ValueError, match="microbatches, records and weights must be as long as each other"):
        xpm.PlannedStep(0, 0, 0, 1, [first], [(0,), (1,)], [1.0])
    assert empty and pickle.loads(pickle.dumps(stand_in, protocol=0)).records == [(0,)]
    for kwargs, error, message in (
            ({"records": [(1.5,)]}, TypeError, r"records\[0\]\[0\] must be an int, got 1.5"),
            ({"microbatches": {"chars": first}}, TypeError, "microbatches must be a list or tuple"),
            ({"rank": 2}, ValueError, r"rank must be in \[0, world_size\) = \[0, 2\), got 2"),
            ({"weights": [float("nan")]}, ValueError, r"weights\[0\] must be a finite number >= 0"),
            ({"predicted_bytes": [1.0, 2.0]}, ValueError, r"predicted_bytes must be empty or one per microbatch")):
        arguments = {"epoch": 0, "index": 0, "rank": 0, "world_size": 2, "microbatches": [first], "records": [(0,)],
                     "weights": [1.0], **kwargs}
        with pytest.raises(error, match="^PlannedStep: " + message):
            xpm.PlannedStep(**arguments)


class _PlainLoaderModule(BigramModule):
    """A plain ``DataLoader(batch_sampler=sampler)`` under automatic optimization: Lightning would
    step the optimizer once per microbatch."""

    def __init__(self, texts):
        super().__init__(texts, automatic=True)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.texts, batch_sampler=self.sampler, collate_fn=_collate)

    def training_step(self, batch, index):
        self.steps_seen.append(index)
        return self.mean_loss(batch)


def test_plain_dataloader_is_refused_without_the_entry_points_guard(monkeypatch):
    """The sampler refuses Lightning's loop itself, so the refusal holds where xpm is imported
    from a build tree (no entry point, no PlainLoaderGuard): the guard is switched off here."""
    from xpm.integrations import lightning_guard

    monkeypatch.setattr(lightning_guard, "callbacks", lambda: [])  # what the entry point gives Lightning
    module, trainer = _PlainLoaderModule(_texts(40)), _trainer(1)
    assert not any(isinstance(c, lightning_guard.PlainLoaderGuard) for c in trainer.callbacks)
    with pytest.raises(ValueError, match=r"^xpm: Lightning's training loop iterates a DataLoader over "
                                         r"PredictiveBatchSampler: .*planned_dataloader"):
        trainer.fit(module)
    assert module.steps_seen == []


# ---- one callback: PlannedMicrobatches plans an unchanged, automatically optimized module

class _TokenMeanModule(lightning.LightningModule):
    """An ordinary LightningModule: automatic optimization, a DataLoader with a batch_size, a
    training_step returning its batch's mean next-character loss (and logging it)."""

    def __init__(self, texts, batch_size=8):
        super().__init__()
        torch.manual_seed(3)
        self.embedding = torch.nn.Embedding(128, 16)
        self.head = torch.nn.Linear(16, 128)
        self.texts, self.batch_size = texts, batch_size

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.texts, batch_size=self.batch_size, shuffle=True,
                                           collate_fn=lambda texts: _collate(texts)["chars"])

    def training_step(self, chars, batch_idx):
        logits = self.head(self.embedding(chars[:, :-1]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 128), chars[:, 1:].reshape(-1), ignore_index=0)
        self.log("loss", loss)
        return loss


class _FirstStep(lightning.Callback):
    """The records and the gradient of the first optimizer step."""

    def __init__(self):
        self.indices, self.gradients = None, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.indices is None:
            self.indices = [i for microbatch in batch.indices for i in microbatch]

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if self.gradients is None:
            self.gradients = [p.grad.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("formula", ["auto", xpm.CostFormula("a*bs*l + c", ["bs", "l"])], ids=["auto", "given"])
def test_one_callback_plans_an_automatic_module_and_accumulates_exactly(formula):
    texts = _texts(200)
    module = _TokenMeanModule(texts)
    planned = xpm_lightning.PlannedMicrobatches(units=lambda text: len(text) - 1, formula=formula)
    first = _FirstStep()
    METER.capacity_bytes = 3_000_000
    try:
        trainer = lightning.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, accumulate_grad_batches=2, callbacks=[first, planned])
        ooms = METER.oom_count
        trainer.fit(module)
        probe_ooms = sum(not p.feasible for p in planned.outcome.probes)
        assert METER.oom_count - ooms - probe_ooms == 0
    finally:
        METER.capacity_bytes = 0
    assert "16 records per optimizer step (batch_size 8 x 2 accumulated x 1 rank(s)" in planned.report
    if formula != "auto":
        assert planned.outcome.model.formula.canonical == formula.canonical
    assert trainer.global_step == 2 * -(-len(texts) // 16)  # one optimizer step per outer batch of 8 x 2
    assert len(first.indices) == 16
    # The step's gradient is the outer batch's token-mean gradient computed in one batch.
    reference = _TokenMeanModule(texts)
    chars = _collate([texts[i] for i in first.indices])["chars"]
    reference.log = lambda *args, **kwargs: None
    reference.training_step(chars, 0).backward()
    for (name, _), planned_gradient, p in zip(module.named_parameters(), first.gradients, reference.parameters()):
        assert torch.allclose(planned_gradient, p.grad, rtol=1e-5, atol=1e-7), name
    print(f"\n{planned.report}")


class _RecurrentModule(_TokenMeanModule):
    """A GRU language model: its backward frees the activations before it writes the GRU's
    weight gradients, so its peak without gradients lies well under the peak with them."""

    def __init__(self, texts):
        super().__init__(texts)
        torch.manual_seed(3)
        self.embedding = torch.nn.Embedding(128, 32)
        self.gru = torch.nn.GRU(32, 128, batch_first=True)
        self.head = torch.nn.Linear(128, 128)
        self.gradients_at_forward = []  # per training_step call: whether any gradient was allocated

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def training_step(self, chars, batch_idx):
        self.gradients_at_forward.append(any(p.grad is not None for p in self.parameters()))
        hidden, _ = self.gru(self.embedding(chars[:, :-1]))
        logits = self.head(hidden)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 128), chars[:, 1:].reshape(-1), ignore_index=0)


class _StepPeaks(lightning.Callback):
    """Per planned step: its microbatches' predictions, and the peak of its last microbatch up to
    its optimizer step (the callback restarts the meter's peak before each microbatch)."""

    def __init__(self):
        self.steps = []

    def on_train_start(self, trainer, module):
        module.gradients_at_forward.clear()  # the probes' forwards

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        xpm.meters.start_peak(METER)
        self.steps.append({"predicted_bytes": list(batch.predicted_bytes)})

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.steps[-1]["peak_bytes"] = METER.peak_allocated_bytes


def test_one_callback_runs_a_step_of_one_microbatch_without_the_last_gradients():
    """A step of one microbatch is predicted as a first microbatch ("without_gradients"): its
    forward must not run with the last step's gradients still alive, as it would if Lightning's
    own zero_grad (between the forward and the backward) were left to free them."""
    texts = _texts(96)
    module, peaks = _RecurrentModule(texts), _StepPeaks()
    planned = xpm_lightning.PlannedMicrobatches(units=lambda text: len(text) - 1, packer="adaptive")
    METER.capacity_bytes = 60_000_000  # an outer batch of 8 x 2 fits one microbatch
    try:
        trainer = lightning.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, accumulate_grad_batches=2, callbacks=[peaks, planned])
        trainer.fit(module)
    finally:
        METER.capacity_bytes = 0
    assert all(len(step["predicted_bytes"]) == 1 for step in peaks.steps) and len(peaks.steps) >= 5
    assert module.gradients_at_forward == [False] * len(peaks.steps)  # without the fix: [False, True, True, ...]
    # Without it the forward held the last step's 331,264 bytes of gradients: -2.1 % to -2.2 %.
    errors = [(step["predicted_bytes"][0] - step["peak_bytes"]) / step["peak_bytes"] for step in peaks.steps[1:]]
    gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    assert min(errors) > -0.015, (errors, gradient_bytes)
    print(f"\nsteps of one microbatch: the model alone {100 * min(errors):+.2f} % to {100 * max(errors):+.2f} % "
          f"of their peaks (gradients {gradient_bytes:,} bytes)")


def test_one_callback_refuses_a_checkpoint_from_the_middle_of_an_epoch(tmp_path):
    """Lightning restarts a planned epoch's steps from the first and stops at the count it had
    left, so the last steps would never train: a mid-epoch checkpoint is refused in one line; one
    saved at an epoch's end resumes."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    texts = _texts(96)  # 6 steps of 8 x 2 records an epoch

    def fit(ckpt_path=None, every=None):
        callbacks = [xpm_lightning.PlannedMicrobatches(units=lambda text: len(text) - 1)]
        if every:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1,
                                             filename="{step}"))
        trainer = lightning.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                                    enable_checkpointing=bool(every), enable_progress_bar=False,
                                    enable_model_summary=False, accumulate_grad_batches=2, callbacks=callbacks)
        trainer.fit(_TokenMeanModule(texts), ckpt_path=ckpt_path)
        return trainer.global_step

    METER.capacity_bytes = 3_000_000
    try:
        assert fit(every=4) == 12
        with pytest.raises(ValueError, match=r"^PlannedMicrobatches: resumed from a checkpoint saved after 4 of the "
                                             r"6 steps of epoch 0: resuming in the middle of an epoch is not "
                                             r"supported"):
            fit(ckpt_path=str(tmp_path / "step=4.ckpt"))
        assert fit(ckpt_path=str(tmp_path / "step=12.ckpt")) == 12  # the fit's end: nothing left
        assert fit(every=6) == 12
        assert fit(ckpt_path=str(tmp_path / "step=6.ckpt")) == 12  # the first epoch's end: the second
    finally:
        METER.capacity_bytes = 0


CALLBACK_WORKER = textwrap.dedent(r'''
    """One rank of a Lightning DDP run planned by PlannedMicrobatches alone; writes rank<r>.json."""
    import json
    import pathlib
    import sys

    import numpy as np
    import torch

    torch.set_num_threads(1)
    import xpm

    meter = xpm.CpuMeter.install()  # before any model is built
    import lightning

    from xpm.integrations.lightning import PlannedMicrobatches

    OUT = pathlib.Path(sys.argv[1])


    def collate(texts):
        chars = torch.zeros(len(texts), max(len(t) for t in texts), dtype=torch.long)
        for row, text in enumerate(texts):
            chars[row, :len(text)] = torch.tensor([ord(c) & 127 or 1 for c in text])
        return chars


    class Module(lightning.LightningModule):
        def __init__(self, texts):
            super().__init__()
            torch.manual_seed(3)
            self.embedding = torch.nn.Embedding(128, 32)
            self.head = torch.nn.Linear(32, 128)
            self.texts = texts

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(self.texts, batch_size=8, shuffle=True, collate_fn=collate)

        def loss(self, chars):
            logits = self.head(self.embedding(chars[:, :-1]))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 128), chars[:, 1:].reshape(-1), ignore_index=0)

        def training_step(self, chars, batch_idx):
            loss = self.loss(chars)
            self.log("loss", loss, sync_dist=True)
            return loss


    class FirstStep(lightning.Callback):
        """Every rank's records of the first step and the all-reduced gradient against them run whole."""

        def __init__(self):
            self.indices, self.seen = None, {"microbatches": 0}

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.seen["microbatches"] += len(batch.batches)
            if self.indices is None:
                self.indices = [i for microbatch in batch.indices for i in microbatch]

        def on_before_optimizer_step(self, trainer, module, optimizer):
            if "max_rel_diff" in self.seen:
                return
            shares = [None] * trainer.world_size
            torch.distributed.all_gather_object(shares, self.indices)
            records = [i for share in shares for i in share]
            capacity, meter.capacity_bytes = meter.capacity_bytes, 0
            reference = Module(module.texts)
            reference.loss(collate([module.texts[i] for i in records])).backward()
            meter.capacity_bytes = capacity
            self.seen["records_first_step"] = len(records)
            self.seen["max_rel_diff"] = max(float((p.grad - r.grad).abs().max() / r.grad.abs().max())
                                            for p, r in zip(module.parameters(), reference.parameters()))


    if __name__ == "__main__":
        rng = np.random.default_rng(11)
        texts = ["".join(rng.choice(list("abcdefgh ")) for _ in range(int(k))) for k in rng.integers(5, 160, 161)]
        module, first = Module(texts), FirstStep()
        planned = PlannedMicrobatches(units=lambda text: len(text) - 1)
        meter.capacity_bytes = 3_000_000
        trainer = lightning.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_epochs=2, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                    accumulate_grad_batches=2, callbacks=[first, planned])
        seen = first.seen
        try:
            ooms = meter.oom_count
            trainer.fit(module)
            seen["ooms"] = meter.oom_count - ooms - sum(not p.feasible for p in planned.outcome.probes)
        except Exception as error:
            seen["error"] = f"{type(error).__name__}: {error}"
        seen.update(rank=trainer.global_rank, global_step=trainer.global_step, report=planned.report,
                    steps_per_epoch=planned.sampler.steps_per_epoch() if planned.sampler else None)
        (OUT / f"rank{trainer.global_rank}.json").write_text(json.dumps(seen))
        sys.exit(1 if "error" in seen else 0)
''')


def test_one_callback_trains_an_automatic_module_on_two_ddp_ranks(tmp_path):
    script = tmp_path / "callback_worker.py"
    script.write_text(CALLBACK_WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("LOCAL_RANK", None)
    env.pop("WORLD_SIZE", None)
    process = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env, timeout=300,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    files = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), process.stdout.decode()[-3000:]
    ranks = [json.loads(f.read_text()) for f in files]
    assert process.returncode == 0, [seen.get("error") for seen in ranks]
    outer = 8 * 2 * 2  # batch_size x accumulate_grad_batches x world size
    for seen in ranks:
        assert seen["ooms"] == 0
        assert seen["global_step"] == 2 * -(-161 // outer) == 2 * seen["steps_per_epoch"]
        assert seen["records_first_step"] == outer and seen["max_rel_diff"] < 1e-5
    assert ranks[0]["global_step"] == ranks[1]["global_step"]
    print(f"\n{ranks[0]['report']}; microbatches per rank {[seen['microbatches'] for seen in ranks]}, "
          f"first step's gradient within {max(seen['max_rel_diff'] for seen in ranks):.1e} of the whole batch's")


@pytest.mark.parametrize("module", ["xpm.integrations.lightning_planning", "xpm.integrations.lightning"])
def test_each_module_imports_on_its_own(module):
    """Either module imported first, in a fresh interpreter (a circular import failed before)."""
    run = subprocess.run([sys.executable, "-c",
                          f"import {module}; from xpm.integrations.lightning import PlannedMicrobatches"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
