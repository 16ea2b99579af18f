"""The environment each dtlib rank gets: torchrun's variables, and its sockets kept on loopback."""

from __future__ import annotations

import pytest

from dtlib.launch.processes import loopback_interface, torchrun_env


@pytest.mark.parametrize("variable", ["GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"])
def test_gloo_and_nccl_sockets_stay_on_loopback_unless_the_user_chose(monkeypatch, variable):
    """NCCL's bootstrap, like gloo, would listen on an interface the network reaches: both get loopback."""
    if not loopback_interface():
        pytest.skip("no loopback interface found")
    monkeypatch.delenv(variable, raising=False)
    assert torchrun_env(0, 2, None)[variable] == loopback_interface()
    monkeypatch.setenv(variable, "eth7")
    assert variable not in torchrun_env(0, 2, None)  # the rank inherits the user's own from the environment


def test_the_store_variables_come_only_with_a_store():
    with_store, without = torchrun_env(1, 2, 29501), torchrun_env(1, 2, None)
    assert (with_store["RANK"], with_store["WORLD_SIZE"], with_store["MASTER_PORT"]) == ("1", "2", "29501")
    assert "MASTER_PORT" not in without and without["LOCAL_RANK"] == "1"


def _seen(rank, world_size):
    import os

    import torch

    return os.environ.get("DTLIB_PROBE"), os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()


@pytest.mark.timeout(60)
def test_variables_given_to_spawn_reach_every_rank_before_torch_looks():
    import dtlib

    seen = dtlib.spawn(_seen, 2, backend="gloo", output="none", env={"DTLIB_PROBE": "x", "CUDA_VISIBLE_DEVICES": ""})
    assert seen == [("x", "", 0)] * 2


@pytest.mark.parametrize(("env", "error", "says"), [
    (["A=1"], TypeError, "dict of variable names"), ({"A": 1}, TypeError, "strings"),
    ({"A=B": "1"}, ValueError, "no environment can hold"), ({"A": "x\0y"}, ValueError, "no environment can hold")])
def test_variables_no_environment_can_hold_are_refused_before_any_rank_starts(env, error, says):
    import dtlib

    with pytest.raises(error, match=says):
        dtlib.spawn(_seen, 2, env=env)


def test_the_checkers_ranks_see_no_gpu():
    from dtlib.checks.skeleton import ON_GLOO

    assert ON_GLOO["backend"] == "gloo" and ON_GLOO["env"] == {"CUDA_VISIBLE_DEVICES": ""}
