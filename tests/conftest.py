"""Tests run on the CPU with 8 simulated devices, so sharding is exercised without a GPU."""

import os

# Must happen before JAX initializes its backends (i.e. before the first JAX operation).
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
