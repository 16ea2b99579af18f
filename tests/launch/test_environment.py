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
