"""Host memory registered with CUDA (`unbroken.update.host_pin`): users of one region share
its registration and the last one to go unregisters it; a re-registration after a remap keeps
every user registered. The driver calls are recorded by a stand-in (the CPU has no CUDA)."""

from __future__ import annotations

import gc

import pytest
import torch

from unbroken.update import host_pin


class _Driver:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", address))
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0


@pytest.fixture
def driver(monkeypatch) -> _Driver:
    d = _Driver()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: d)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(host_pin, "_users", {})
    return d


def test_users_of_one_region_share_its_registration_and_the_last_one_unregisters(driver):
    pages = torch.zeros(4096, dtype=torch.uint8)
    address, device = pages.data_ptr(), torch.device("cuda", 0)
    first, second = (
        host_pin.HostRegistration(pages, device),
        host_pin.HostRegistration(pages, device),
    )
    first.ensure()
    second.ensure()
    first.ensure()  # idempotent
    assert driver.calls == [("register", address)]
    del first
    gc.collect()
    assert driver.calls == [("register", address)]  # the second user still reads it
    del second
    gc.collect()
    assert driver.calls == [("register", address), ("unregister", address)]
    assert host_pin._users == {}


def test_a_remapped_region_is_registered_again_for_every_user(driver):
    pages = torch.zeros(4096, dtype=torch.uint8)
    address, device = pages.data_ptr(), torch.device("cuda", 0)
    users = [host_pin.HostRegistration(pages, device) for _ in range(2)]
    for user in users:
        user.ensure()
    users[0].reregister()
    assert driver.calls == [("register", address), ("unregister", address), ("register", address)]
    assert host_pin._users == {address: 2}
    del users, user
    gc.collect()
    assert driver.calls[-1] == ("unregister", address) and host_pin._users == {}


def test_only_a_contiguous_host_tensor_is_registered(driver):
    with pytest.raises(ValueError, match="contiguous host tensor"):
        host_pin.HostRegistration(torch.zeros(8, 8)[:, 0], torch.device("cuda", 0))
