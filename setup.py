"""Package discovery for specdec, whose repository root is the package itself.

pyproject.toml maps ``specdec`` to the repository root (``package-dir``), but setuptools' own
discovery (``[tool.setuptools.packages.find]``) names what it finds after the folders, which here would
install ``models``, ``decode`` ... as top-level packages, and it cannot name the root folder ``specdec``
since clones are named anything. So every folder with an ``__init__.py`` below the root is listed
under ``specdec.``; tests/ is a package for pytest's imports but not part of specdec. Folders without
an ``__init__.py`` (scripts/, benchmarks/, docs/, families/) are not packages and are not descended into.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent

setup(
    packages=["specdec", *(f"specdec.{name}" for name in find_packages(where=str(ROOT), exclude=["tests", "tests.*"]))],
    # this script sits in the specdec package's folder: build_py leaves the setup script out of a package, but
    # under a PEP 517 backend the name it compares with is the backend's own script unless given here
    script_name="setup.py",
)
