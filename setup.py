"""Package discovery (the metadata is in pyproject.toml).

Every package under ``wavetune_jax/`` and ``pallas_kernels/`` is found, not
listed by hand. The shipped tables live in ``tables/<device_key>/<family>.json``
at the repository root; installed, they become the data package
``wavetune_jax.shipped_tables`` (one subpackage per GPU, JSON files only).
"""

from setuptools import find_namespace_packages, find_packages, setup

CODE = find_packages(include=["wavetune_jax", "wavetune_jax.*",
                              "pallas_kernels", "pallas_kernels.*"])
TABLES = ["wavetune_jax.shipped_tables"] + [
    f"wavetune_jax.shipped_tables.{gpu}" for gpu in find_namespace_packages(where="tables")]

setup(
    packages=CODE + TABLES,
    package_dir={"wavetune_jax.shipped_tables": "tables"},
    package_data={"wavetune_jax.shapes": ["*.json"], "wavetune_jax.shipped_tables": ["*/*.json"]},
    include_package_data=False,
)
