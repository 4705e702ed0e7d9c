"""The package list, which pyproject.toml cannot compute: pagedjax/ itself, and the design
card's top-level folders installed under the pagedjax name (models/ -> pagedjax.models,
scheduler/ -> pagedjax.scheduler, pallas_kernels/ -> pagedjax.pallas_kernels), so an install
puts no generic top-level import name (`models`, `scheduler`) into a user's environment.
Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

MAPPED = ("models", "scheduler", "pallas_kernels")

packages = find_packages(include=["pagedjax", "pagedjax.*"])
for folder in MAPPED:
    packages += [f"pagedjax.{name}" for name in find_packages(include=[folder, f"{folder}.*"])]

setup(packages=packages, package_dir={f"pagedjax.{folder}": folder for folder in MAPPED})
