"""devices/hardware.py: device kinds as JAX names them find their chip, and the peaks scale with the count."""

import types

import pytest

from devices import hardware


@pytest.mark.parametrize(
    "device_kind, chip",
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("TPU v4", "TPU v4"),
        ("TPU v5 lite", "TPU v5 lite"),
        ("TPU v5e", "TPU v5 lite"),
        ("TPU v5p", "TPU v5p"),
        ("TPU v6 lite", "TPU v6 lite"),
        ("TPU v6e", "TPU v6 lite"),
    ],
)
def test_device_kinds_find_their_chip(device_kind, chip):
    assert hardware.chip_of(device_kind).kinds[0] == chip


def test_an_unknown_chip_has_no_made_up_peak():
    assert hardware.chip_of("NVIDIA GeForce RTX 4090") is None
    devices = [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA GeForce RTX 4090")]
    assert hardware.peak_flops(devices) == (None, "unknown peak for 'NVIDIA GeForce RTX 4090'")
    assert hardware.peak_bandwidth(devices)[0] is None


def test_peaks_are_per_chip_times_the_devices_used():
    devices = [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")] * 8
    assert hardware.peak_flops(devices) == (8 * 989e12, "H200 datasheet bf16 x 8")
    assert hardware.peak_bandwidth(devices) == (8 * 4.8e12, "H200 datasheet x 8")


def test_only_a_measured_cpu_peak_is_measured_again_and_the_best_kept(monkeypatch):
    rates = iter([3e9, 1e9])
    monkeypatch.setattr(hardware, "measure_cpu_peak_flops", lambda: next(rates))
    cpus = [types.SimpleNamespace(platform="cpu", device_kind="cpu")] * 8
    assert hardware.best_peak_flops(cpus, 2e9) == 3e9
    assert hardware.best_peak_flops(cpus, 2e9) == 2e9
    h200s = [types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")]
    assert hardware.best_peak_flops(h200s, 989e12) == 989e12  # no measurement taken
    assert hardware.best_peak_flops([types.SimpleNamespace(platform="gpu", device_kind="?")], None) is None


def test_tpu_generations_describe_their_slices():
    assert {g: (c.torus_dims, c.cores_per_chip) for g, c in hardware.TPU_GENERATIONS.items()} == {
        "v4": (3, 2),
        "v5e": (2, 1),
        "v5p": (3, 2),
        "v6e": (2, 1),
    }
