import os

# Tests run on the CPU: Pallas kernels in interpret mode.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
