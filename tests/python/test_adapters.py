"""The per-step adapter's contract in a plain loop of one item per optimizer step (training_step,
then optimizer.step); the real trainers are tested in tests/python/integrations/."""
import numpy as np
import torch

import xpm


class OneItemPerStepLoop:
    """A loop of one item per optimizer step: training_step, then one optimizer step."""

    def __init__(self, model, optimizer, training_step):
        self.model, self.optimizer, self.training_step = model, optimizer, training_step
        self.gradients = []

    def train(self, loader):
        for inputs in loader:
            self.training_step(self.model, inputs)
            self.gradients.append([p.grad.clone() for p in self.model.parameters()])
            self.optimizer.step()
            self.optimizer.zero_grad()


def test_one_item_per_step_gives_each_step_the_outer_batch_gradient():
    torch.manual_seed(2)
    rng = np.random.default_rng(4)
    lengths = rng.integers(2, 30, 96)
    features = [torch.randn(int(n), 3, dtype=torch.float64) for n in lengths]
    dataset = list(range(len(lengths)))
    formula = xpm.CostFormula("a*bs*l + c", ["bs", "l"])
    dims = np.array([[1, 10], [4, 20], [8, 30]], dtype=float)
    model_of_memory, _ = xpm.fit(formula, dims, 1000 * dims[:, 0] * dims[:, 1] + 10_000)
    sampler = xpm.PredictiveBatchSampler(lengths, model_of_memory, 100_000, outer_batch_size=32, seed=3,
                                         units=lengths)
    steps = xpm.StepDataset(dataset, sampler, collate_fn=lambda ids: ids)
    assert len(steps) == 3
    loader = torch.utils.data.DataLoader(steps, batch_size=None, shuffle=False)
    net = torch.nn.Linear(3, 1).double()
    start = [p.detach().clone() for p in net.parameters()]

    def mean_loss(ids):  # mean over the microbatch's rows (units: one per row)
        rows = torch.cat([features[i] for i in ids])
        return net(rows).pow(2).sum() / rows.shape[0]

    trainer = OneItemPerStepLoop(net, torch.optim.SGD(net.parameters(), lr=0.1),
                             lambda model, inputs: xpm.accumulate(inputs, mean_loss, torch.Tensor.backward))
    trainer.train(loader)
    seen = [i for item in steps for ids, _ in item for i in ids]
    assert sorted(seen) == dataset
    # The first step's gradient is the first outer batch's mean-loss gradient.
    first = [i for ids, _ in steps[0] for i in ids]
    with torch.no_grad():
        for p, s in zip(net.parameters(), start):
            p.copy_(s)
    net.zero_grad()
    mean_loss(first).backward()
    for g, p in zip(trainer.gradients[0], net.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-9, rtol=0)
