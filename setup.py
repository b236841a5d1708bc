"""Package discovery only; everything else is in pyproject.toml.

``calibration/`` sits at the top of the checkout (DESIGN.md "Layout") and is installed as
``fp8export.calibration``. pyproject.toml's static ``find`` cannot rename a tree, so both trees
are discovered here: a new subpackage of either is packaged without anyone listing it, with or
without an ``__init__.py`` (namespace discovery).
"""

from setuptools import find_namespace_packages, setup

CALIBRATION = "calibration"
SKIP = ["*__pycache__*"]


def _find(root: str) -> list[str]:
    return find_namespace_packages(include=[root, f"{root}.*"], exclude=SKIP)


packages = _find("fp8export") + ["fp8export." + p for p in _find(CALIBRATION)]

setup(packages=packages, package_dir={"fp8export.calibration": CALIBRATION})
