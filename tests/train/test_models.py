"""dtlib.train.models: the same seed gives the same weights everywhere, shapes as documented, losses as torch
defines them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtlib.train import models


def _flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("name", models.MODELS)
def test_same_seed_same_weights_other_seed_other_weights(name):
    first, again, other = models.build(name, seed=0), models.build(name, seed=0), models.build(name, seed=1)
    for (key, a), (key_again, b) in zip(first.state_dict().items(), again.state_dict().items(), strict=True):
        assert key == key_again
        assert torch.equal(a, b), f"{name}: {key} differs between two builds with seed 0"
    assert not torch.equal(_flat_params(first), _flat_params(other)), f"{name}: seeds 0 and 1 give the same weights"


def test_build_leaves_the_global_random_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    models.build("transformer", seed=7)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", ["mlp", "wide_mlp", "branchy", "batchnorm"])
def test_mlp_like_models_map_features_to_one_output(name):
    x = torch.randn(5, models.IN_FEATURES)  # (B, 16)
    assert models.build(name)(x).shape == (5, 1)


@pytest.mark.parametrize("seq_len", [models.SEQ_LEN, 5])
def test_transformer_maps_tokens_to_logits_over_the_vocabulary(seq_len):
    tokens = torch.randint(models.VOCAB, (3, seq_len))  # (B, T)
    assert models.build("transformer")(tokens).shape == (3, seq_len, models.VOCAB)


def test_transformer_is_causal():
    """Changing the last token must not change the logits of earlier positions."""
    model = models.build("transformer").eval()
    tokens = torch.randint(models.VOCAB, (2, models.SEQ_LEN))
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % models.VOCAB
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_unknown_name_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="unknown model 'resnet'") as info:
        models.build("resnet")
    for name in models.MODELS:
        assert name in str(info.value)


def _linear_params(sizes: list[int]) -> int:
    return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(sizes, sizes[1:], strict=False))


def test_wide_mlp_is_five_linear_layers_of_width_512_and_fills_several_buckets():
    wide = models.build("wide_mlp")
    count = sum(p.numel() for p in wide.parameters())
    assert count == _linear_params([16, 512, 512, 512, 512, 1])  # 797,185
    assert count * 4 > 3 * 2**20  # float32 gradients: more than three 1 MiB buckets' worth
    assert sum(p.numel() for p in models.build("mlp").parameters()) == _linear_params([16, 64, 64, 1])


def test_wide_mlp_has_the_parameter_count_its_docstring_gives():
    count = sum(p.numel() for p in models.build("wide_mlp").parameters())
    assert f"{count:,} parameters" in models.build.__doc__


def test_branch_parameters_get_gradients_only_when_the_branch_is_used():
    model = models.build("branchy")
    x = torch.randn(4, models.IN_FEATURES)
    model(x).sum().backward()
    assert model.branch.weight.grad is None and model.branch.bias.grad is None
    assert model.head.weight.grad is not None and model.trunk[0].weight.grad is not None
    model.use_branch = True
    model(x).sum().backward()
    assert model.branch.weight.grad is not None and model.branch.bias.grad is not None


def test_batchnorm_model_has_running_statistics_that_training_updates():
    model = models.build("batchnorm")
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    assert {"net.1.running_mean", "net.1.running_var"} <= set(buffers)
    model(torch.randn(8, models.IN_FEATURES) + 3.0)
    assert not torch.equal(model.net[1].running_mean, buffers["net.1.running_mean"])


def test_loss_fn_is_mse_for_regression_and_token_cross_entropy_for_the_transformer():
    output, target = torch.randn(6, 1), torch.randn(6, 1)
    torch.testing.assert_close(models.loss_fn("mlp", output, target), ((output - target) ** 2).mean())
    logits, tokens = torch.randn(2, 5, models.VOCAB), torch.randint(models.VOCAB, (2, 5))  # (B, T, V), (B, T)
    expected = torch.stack([F.cross_entropy(logits[b, t][None], tokens[b, t][None])
                            for b in range(2) for t in range(5)]).mean()
    torch.testing.assert_close(models.loss_fn("transformer", logits, tokens), expected)
