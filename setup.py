"""Package discovery only; everything else is in pyproject.toml.

``calibration/`` sits at the top of the checkout (DESIGN.md "Layout") and is installed as
``fp8export.calibration``. pyproject.toml's static ``find`` cannot rename a tree, so both trees
are discovered here: a new subpackage of either is packaged without anyone listing it.
"""

from setuptools import find_packages, setup

CALIBRATION = "calibration"

packages = find_packages(include=["fp8export", "fp8export.*"])
packages += ["fp8export." + p for p in find_packages(include=[CALIBRATION, f"{CALIBRATION}.*"])]

setup(packages=packages, package_dir={"fp8export.calibration": CALIBRATION})
