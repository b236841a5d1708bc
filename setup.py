"""Package discovery only; everything else is in pyproject.toml.

``calibration/`` sits at the top of the checkout (DESIGN.md "Layout") and is installed as
``fp8export.calibration``. pyproject.toml's static ``find`` cannot rename a tree, so both trees
are discovered here: a new subpackage of either is packaged without anyone listing it, with or
without an ``__init__.py`` (namespace discovery).
"""

from setuptools import Extension, find_namespace_packages, setup

CALIBRATION = "calibration"
SKIP = ["*__pycache__*"]


def _find(root: str) -> list[str]:
    return find_namespace_packages(include=[root, f"{root}.*"], exclude=SKIP)


packages = _find("fp8export") + ["fp8export." + p for p in _find(CALIBRATION)]

# The E4M3 table-lookup loop (fp8export/numerics/lut.py). optional=True: without a compiler the
# wheel still builds and lut.py falls back to numpy (same bytes, slower). No Python API in it
# (ctypes loads it), hence no py_limited_api concerns.
FP8LUT = Extension("fp8export.numerics._fp8lut", ["fp8export/numerics/_fp8lut.c"],
                   extra_compile_args=["-O3"], optional=True)

setup(packages=packages, package_dir={"fp8export.calibration": CALIBRATION},
      ext_modules=[FP8LUT])
