"""The compute policy: how the core holds weights per backend and budget."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest

from turbospark_core.compute import ComputePolicy

# ------------------------------------------------------------------ ComputePolicy


@pytest.fixture
def on_cpu() -> Iterator[None]:
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(old)


def test_policy_on_cpu_unpacks_when_it_fits(on_cpu: None) -> None:
    policy = ComputePolicy.choose(unpacked_bytes=4_000_000_000, stored_bytes=1_000_000_000, budget=4_000_000_000)
    assert policy.unpack and policy.compute_dtype == mx.float32
    assert "cpu" in policy.reason and "fit" in policy.reason


def test_policy_on_cpu_keeps_stored_form_when_unpacking_does_not_fit(on_cpu: None) -> None:
    policy = ComputePolicy.choose(unpacked_bytes=4_000_000_001, stored_bytes=1_000_000_000, budget=4_000_000_000)
    assert not policy.unpack and policy.compute_dtype == mx.float32
    assert "exceed" in policy.reason and "4.00 GB" in policy.reason and "1.00 GB" in policy.reason


def test_policy_on_gpu_keeps_quantized_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    policy = ComputePolicy.choose(unpacked_bytes=1, stored_bytes=1, budget=10**12)
    assert not policy.unpack and "gpu" in policy.reason
