"""Tests run on the CPU with 8 simulated devices, so sharding is exercised without a GPU.

The tests marked `tpu` (tests/test_tpu.py) need the chip: NANOMAX_TEST_PLATFORM=tpu leaves JAX's
platform alone (no CPU pinning, no simulated devices) so that they run on it; everywhere else they
are skipped with one reason, the command that runs them (docs/tpu.md).
"""

import atexit
import os
import shutil
import tempfile

import pytest

ON_CHIP = os.environ.get("NANOMAX_TEST_PLATFORM", "") == "tpu"
CHIP_COMMAND = "needs a TPU: NANOMAX_TEST_PLATFORM=tpu python -m pytest -n 0 -m tpu"

if not ON_CHIP:
    # Must happen before JAX initializes its backends (i.e. before the first JAX operation).
    os.environ["JAX_PLATFORMS"] = "cpu"
    # LLVM's optimisation of the generated CPU code takes about a third of the suite's time and buys
    # nothing for programs this small; XLA's own (HLO) optimisations still run.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    )

# Many tests compile the same small programs, and the train.py runs they start compile them again:
# a compilation cache for this session (inherited by those processes) compiles each program once.
# It starts empty, so every program is still compiled by this run.
# Under pytest-xdist the workers inherit the controller's cache, so a program compiled by one is
# found by the other; the controller removes it at the end.
if "PYTEST_XDIST_WORKER" not in os.environ:
    _compilation_cache = tempfile.mkdtemp(prefix="nanomax-tests-xla-cache-")
    atexit.register(shutil.rmtree, _compilation_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _compilation_cache
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_collection_modifyitems(config, items):
    """Skip the `tpu` tests unless this run is on a TPU (asked for, and found)."""
    chip_tests = [item for item in items if "tpu" in item.keywords]
    if not chip_tests:
        return
    if ON_CHIP:
        import jax  # only now: on the chip, the first JAX call takes the TPU

        if jax.devices()[0].platform == "tpu":
            return
        reason = f"NANOMAX_TEST_PLATFORM=tpu, but JAX found no TPU ({jax.devices()[0].platform})"
    else:
        reason = CHIP_COMMAND
    for item in chip_tests:
        item.add_marker(pytest.mark.skip(reason=reason))
