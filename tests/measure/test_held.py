"""dtlib.measure.held: what a model holds while it runs, against counts made by hand. The bytes autograd saves
for backward (activations once, never a parameter; a checkpointed function only its input), and the largest
parameter bytes a model holds at once."""

from __future__ import annotations

import torch

from dtlib.measure.held import parameter_peak, saved_for_backward
from dtlib.train import models

S = sum(p.numel() * p.element_size() for p in models.build("transformer").parameters())


def test_saved_for_backward_counts_activations_once_and_no_parameter():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 8)
    x = torch.randn(2, 4, requires_grad=True)  # (B, C_in) fp32: 32 bytes
    with saved_for_backward(layer) as saved:
        torch.tanh(layer(x))  # the linear saves x (its weight is a parameter), tanh its (2, 8) output
    assert saved.nbytes == 2 * 4 * 4 + 2 * 8 * 4
    with saved_for_backward(layer) as saved:
        torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(layer(t)), x, use_reentrant=False)
    assert saved.nbytes == 2 * 4 * 4  # a checkpointed function keeps only its input


def test_parameter_peak_of_an_unsharded_model_is_all_of_it():
    model = models.build("transformer")
    with parameter_peak(model) as peak:
        model(torch.zeros(2, 16, dtype=torch.long))
    assert peak.nbytes == S
    assert all(not module._forward_hooks for module in model.modules())  # the hooks are gone afterwards
