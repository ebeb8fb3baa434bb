"""``DeviceMemoryMonitor``: the peak a GPU had in use between two reads, across processes (NVML),
and nothing at all without NVML. NVML is replaced by a stand-in whose reading the test moves."""

from __future__ import annotations

import sys
import time
import types

import pytest

from rl_bridge.loop.metrics import DeviceMemoryMonitor

pytestmark = pytest.mark.unit

GIB = 2**30


def _fake_nvml(readings: list[int]) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda index: f"gpu{index}"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=readings[-1])  # type: ignore[attr-defined]
    return nvml


def test_the_peak_between_two_reads_is_kept_and_then_starts_again(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = [10 * GIB]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(readings))
    monitor = DeviceMemoryMonitor(interval_s=0.005)
    try:
        readings.append(90 * GIB)  # vLLM awake and the policy's state: the peak of the step
        time.sleep(0.1)
        readings.append(40 * GIB)  # vLLM asleep
        time.sleep(0.05)
        assert monitor.take_peak() == pytest.approx(90.0)
        time.sleep(0.05)
        assert monitor.take_peak() == pytest.approx(40.0), "a new interval starts at each read"
    finally:
        monitor.close()


def test_without_nvml_nothing_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    monitor = DeviceMemoryMonitor()
    assert monitor.take_peak() is None
    monitor.close()
