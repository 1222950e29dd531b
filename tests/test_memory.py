"""Tests of the memory guard: budget parsing, the estimate, and the over-budget refusal."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

import turbospark_core
from turbospark_core import loader, memory
from turbospark_core.errors import MemoryBudgetError, OptionError
from turbospark_core.memory import (
    DEFAULT_FRACTION,
    MemoryEstimate,
    available_bytes,
    parse_budget,
    release_freed_heap,
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1000, 1000),
        (8e9, 8_000_000_000),
        ("1000", 1000),
        ("8GB", 8_000_000_000),
        ("8 gb", 8_000_000_000),
        ("1.5G", 1_500_000_000),
        ("512MiB", 512 * 2**20),
        ("2kib", 2048),
        ("3kb", 3000),
        (" 7 B ", 7),
    ],
)
def test_parse_budget(value, expected: int) -> None:
    assert parse_budget(value) == expected


def test_default_budget_is_a_fraction_of_free_memory() -> None:
    free = available_bytes()
    assert free > 0
    budget = parse_budget(None)
    assert 0 < budget <= free * DEFAULT_FRACTION * 1.1  # free memory moves a little between calls


@pytest.mark.parametrize(
    "value",
    [
        "garbage",
        "8XB",
        "-5GB",
        "",
        0,
        -1,
        "0GB",
        True,
        pytest.param("1.2.3GB"),
        pytest.param("."),
        pytest.param(float("nan")),
        pytest.param(float("inf")),
        pytest.param([8]),
    ],
)
def test_unparseable_budget(value, names) -> None:
    with pytest.raises(OptionError) as e:
        parse_budget(value)
    names(e, "memory_budget=")


def test_estimate_total_and_check() -> None:
    est = MemoryEstimate(weights=600, kv=300, experts=100)
    assert est.total == 1000
    est.check(1000, max_context=256, slots=1)  # exactly at the budget fits
    with pytest.raises(MemoryBudgetError) as e:
        est.check(999, max_context=256, slots=3)
    assert isinstance(e.value, MemoryError)
    assert "max_context=256 x 3 slot(s)" in str(e.value)


def test_over_budget_open_is_refused_naming_the_knobs(
    f32_install: Path, monkeypatch: pytest.MonkeyPatch, names
) -> None:
    def no_mapping(*args, **kwargs):
        raise AssertionError("weights were mapped before the budget check")

    monkeypatch.setattr(loader, "WeightStore", no_mapping)
    with pytest.raises(MemoryBudgetError) as e:
        turbospark_core.open(f32_install, memory_budget=1000)
    names(e, "max_context=256", "memory_budget", "lower max_context", "raise memory_budget")


def test_lowering_max_context_makes_an_open_fit(f32_install: Path) -> None:
    small = turbospark_core.open(f32_install, max_context=256).opened.estimate
    big = turbospark_core.open(f32_install, max_context=8192).opened.estimate
    assert big.weights == small.weights and big.kv == small.kv * 32
    budget = small.total + 1
    assert turbospark_core.open(f32_install, max_context=256, memory_budget=budget).max_context == 256
    with pytest.raises(MemoryBudgetError, match="max_context=8192"):
        turbospark_core.open(f32_install, max_context=8192, memory_budget=budget)


def test_estimate_counts_weights_and_kv(f32_install: Path) -> None:
    opened = turbospark_core.open(f32_install, max_context=100).opened
    # 2 layers x (K + V) x 2 kv heads x head_dim 16 x 100 tokens x float32
    assert opened.estimate.kv == 2 * 2 * 2 * 16 * 100 * 4
    assert opened.estimate.weights == opened.index.stored_bytes()


def test_estimate_counts_the_exact_recent_tokens(turbospark_install) -> None:
    """q4 KV at 100 tokens, plus each layer's ring of recent tokens kept unquantized (window + verify slack)."""
    path = turbospark_install("qwen3", "float32")
    plain = turbospark_core.open(path, max_context=100, kv_quant="q4", kv_recent=0).opened.estimate.kv
    recent = turbospark_core.open(path, max_context=100, kv_quant="q4", kv_recent=8).opened.estimate.kv
    drafting = turbospark_core.open(path, max_context=100, kv_quant="q4", kv_recent=8, ngram=3).opened.estimate.kv
    per_token = 2 * 2 * 2 * 32 * 4  # 2 layers x (K + V) x 2 kv heads x head_dim 32 x float32
    assert recent - plain == 8 * per_token
    default = turbospark_core.open(path, max_context=100, kv_quant="q4").opened.estimate.kv
    assert default - plain == 32 * per_token  # q4's default: the last 32 tokens exact
    q8 = [turbospark_core.open(path, max_context=100, kv_quant="q8", kv_recent=r).opened.estimate.kv for r in (None, 0)]
    assert q8[0] == q8[1]  # q8's default keeps none exact
    assert drafting - plain == (8 + 3 + 1) * per_token  # ngram=3 verifies trim up to 4 tokens


# run in a child: the heap's thresholds are set there, not in the test process
_HEAP_CHILD = """
import ctypes, ctypes.util
from turbospark_core.memory import release_freed_heap

def resident_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 64 KB blocks come from the heap
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() does not shrink the heap by itself
blocks = [libc.malloc(65536) for _ in range(2048)]  # 128 MB
for b in blocks:
    ctypes.memset(b, 1, 65536)
for b in blocks:
    libc.free(b)
before = resident_kb()
print(release_freed_heap(), before, resident_kb())
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists() or platform.libc_ver()[0] != "glibc",
                    reason="malloc_trim is glibc's; residency is read from /proc")
def test_release_freed_heap_hands_freed_pages_back() -> None:
    out = subprocess.run([sys.executable, "-c", _HEAP_CHILD], capture_output=True, text=True, check=True).stdout
    released, before, after = out.split()
    assert released == "True"
    assert int(after) < int(before) - 100_000  # most of the 128 MB freed left the process


def test_release_freed_heap_without_glibc_does_nothing(monkeypatch) -> None:
    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: object())  # a C library without malloc_trim
    memory._malloc_trim.cache_clear()
    try:
        assert release_freed_heap() is False
    finally:
        memory._malloc_trim.cache_clear()
