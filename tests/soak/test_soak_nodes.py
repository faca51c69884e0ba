"""The soak's node keeper with real agent processes (no coordinator listens: they wait to
connect): the last node is started again after a SIGKILL, with its lost devices cleared from
the registry, and not after any other end."""

from __future__ import annotations

import os
import signal

import pytest

from unbroken.bench.soak_nodes import NodeKeeper, node_address
from unbroken.devices import DeviceRegistry


@pytest.mark.timeout(120)
def test_the_last_node_comes_back_after_a_sigkill_with_its_devices_replaced(tmp_path):
    registry = DeviceRegistry(tmp_path / "devices")
    registry.mark_lost(3, "lose fault")
    registry.mark_lost(1, "a device of node 0")
    keeper = NodeKeeper(2, 2, tmp_path / "devices", connect_timeout_s=100, reboot_s=0.1)
    with keeper:
        first = keeper.agent(1)
        os.kill(first.pid, signal.SIGKILL)
        assert keeper.wait_restarts(1, 60)
        (back,) = keeper.restarts
        assert back.returncode == -signal.SIGKILL and back.cleared == (3,)
        assert registry.lost(3) is None  # node 1's hardware was replaced ...
        assert registry.lost(1) == "a device of node 0"  # ... node 0's was not
        second = keeper.agent(1)
        assert second.pid != first.pid and second.poll() is None
        second.terminate()  # an end other than SIGKILL (a fence, the job's end): not again
        assert not keeper.wait_restarts(2, 60)
        assert not keeper.keeping and second.wait() == -signal.SIGTERM
    assert len(keeper.restarts) == 1


def test_a_job_of_one_node_has_nothing_to_keep(tmp_path):
    with pytest.raises(ValueError, match="one node"):
        NodeKeeper(1, 4, tmp_path)
    assert [node_address(n) for n in range(3)] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
