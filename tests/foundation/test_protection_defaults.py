"""Protection sizes left unset take the defaults of the device the job trains on."""

import pytest

from unbroken import api
from unbroken.config import JobConfig, ProtectionConfig
from unbroken.engine.replica import state_geometry
from unbroken.errors import UserError

MIB = 1 << 20


def test_unset_sizes_resolve_per_device():
    p = ProtectionConfig()
    assert (p.page_bytes, p.chunk_bytes, p.stripe_pages) == (None, None, None)
    cpu, gpu = p.resolved(cuda=False), p.resolved(cuda=True)
    assert (cpu.page_bytes, cpu.chunk_bytes, cpu.stripe_pages) == (64 << 10, 32 << 10, 8)
    assert (gpu.page_bytes, gpu.chunk_bytes, gpu.stripe_pages) == (2 * MIB, 2 * MIB, 64)
    assert gpu.resolved(cuda=False) == gpu  # resolved sizes stay


def test_a_stripe_set_by_the_user_is_kept_and_a_default_one_fits_a_large_first_tier():
    assert ProtectionConfig(stripe_pages=80).resolved(cuda=True).stripe_pages == 80
    assert ProtectionConfig(stripe_pages=4).resolved(cuda=False).stripe_pages == 4
    wide = ProtectionConfig(parity_pages=200).resolved(cuda=True)
    assert wide.stripe_pages == 18 and 3 * wide.stripe_pages + wide.parity_pages <= 256
    with pytest.raises(ValueError, match="<= 256"):
        ProtectionConfig(stripe_pages=80, parity_pages=20)


@pytest.mark.parametrize(
    ("page", "chunk", "cuda", "want"),
    [
        (4 * MIB, None, True, (4 * MIB, 2 * MIB)),
        (64 << 10, None, True, (64 << 10, 64 << 10)),  # the GPU chunk exceeds the page
        (12288, None, False, (12288, 12288)),  # 32 KiB does not divide 12 KiB
        (None, 1 * MIB, True, (2 * MIB, 1 * MIB)),
        (None, 4096, False, (64 << 10, 4096)),
    ],
)
def test_a_size_set_by_the_user_is_kept_and_the_other_fits_it(page, chunk, cuda, want):
    p = ProtectionConfig(page_bytes=page, chunk_bytes=chunk).resolved(cuda)
    assert (p.page_bytes, p.chunk_bytes) == want


def test_a_chunk_that_cannot_divide_the_default_page_is_refused():
    with pytest.raises(ValueError, match="divides page_bytes"):
        ProtectionConfig(chunk_bytes=3 * MIB).resolved(cuda=True)
    cfg = JobConfig(protection=ProtectionConfig(chunk_bytes=192))
    with pytest.raises(UserError, match="divides page_bytes"):
        api.resolve_device_defaults(cfg)


def test_a_gpu_job_with_default_protection_gets_the_gpu_page(monkeypatch):
    monkeypatch.setattr(api, "_on_cuda", lambda cfg: True)
    cfg = api.resolve_device_defaults(JobConfig())
    assert cfg.protection.page_bytes == api.GPU_PAGE_BYTES
    assert api._check_gpu_retained(cfg)  # in place on a GPU: no page-size error any more
    # The geometry every process builds from this resolved config is the GPU one, even where
    # it is built without a device (the coordinator's side).
    g = state_geometry(cfg, 76_000_000)
    assert (g.page_bytes, g.chunk_bytes, g.stripe_pages) == (2 * MIB, 2 * MIB, 64)


def test_the_first_tier_is_three_vandermonde_pages_on_a_gpu_and_four_cauchy_ones_on_the_cpu():
    """protection.code = auto: the Vandermonde code (Horner's rule in the fused GPU update)
    where it is MDS and the job trains on a GPU; an H1 or code the user set is kept."""
    p = ProtectionConfig()
    assert (p.parity_pages, p.code) == (None, "auto")
    gpu, cpu = p.resolved(cuda=True), p.resolved(cuda=False)
    assert (gpu.parity_pages, gpu.code) == (3, "vandermonde")
    assert (cpu.parity_pages, cpu.code) == (4, "cauchy")
    assert gpu.resolved(cuda=False) == gpu
    assert ProtectionConfig(parity_pages=2).resolved(cuda=True).code == "vandermonde"
    assert ProtectionConfig(parity_pages=4).resolved(cuda=True).code == "cauchy"
    cauchy = ProtectionConfig(code="cauchy").resolved(cuda=True)
    assert (cauchy.parity_pages, cauchy.code) == (4, "cauchy")
    forced = ProtectionConfig(code="vandermonde").resolved(cuda=False)
    assert (forced.parity_pages, forced.code) == (3, "vandermonde")
    with pytest.raises(ValueError, match="MDS"):
        ProtectionConfig(code="vandermonde", parity_pages=4)
