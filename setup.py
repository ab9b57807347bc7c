"""Build hook for the optional extensions; the package metadata is in pyproject.toml.

csrc/build.py decides, and never fails the install: the CUDA kernels (megarl._C) are built only
when a CUDA toolkit and a CUDA build of torch are both present; without them megarl runs the
torch path.
Install with `pip install --no-build-isolation -e .[dev]` (launchers/local/setup.sh) so that
the build sees the installed torch.
"""
import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))

ext_modules, cmdclass = [], {}
try:
    from build import get_extensions  # csrc/build.py

    ext_modules, cmdclass = get_extensions()
except ImportError:
    pass

setup(ext_modules=ext_modules, cmdclass=cmdclass)
