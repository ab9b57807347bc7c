"""Install megarl: `pip install -e .[dev]`.

torch is pinned per Python version so that pip never swaps a local CPU build for the
multi-GB CUDA wheel: on Python 3.11 we ask for exactly the release megatron-core 0.16.x
supports; on >= 3.12 any torch >= 2.6 already installed satisfies the requirement.
The CUDA kernels in csrc/ are built only when a CUDA toolkit and a CUDA build of torch
are both present (see csrc/build.py); otherwise megarl runs the exact torch path.
"""
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "csrc"))

install_requires = [
    "numpy",
    "packaging",
    "pyyaml>=6",
    "safetensors>=0.4",
    "tokenizers>=0.19",
    "mlflow>=2.14",
    "tqdm",
    "psutil",  # CPU/RSS system metrics
    "matplotlib",  # megarl report
    "torch==2.13.0; python_version<'3.12'",
    "torch>=2.6; python_version>='3.12'",
    "megatron-core==0.16.*; python_version<'3.12'",
    "megatron-core>=0.16; python_version>='3.12'",
]

extras = {
    "dev": ["pytest>=8", "pytest-timeout", "transformers>=4.45", "matplotlib"],
    "gpu": ["transformer-engine[pytorch]"],
    "dali": ["nvidia-dali-cuda130"],
}

ext_modules, cmdclass = [], {}
try:  # build.py decides whether a CUDA build is possible; it never fails the install
    from build import get_extensions  # csrc/build.py

    ext_modules, cmdclass = get_extensions()
except ImportError:
    pass

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-style 3D-parallel RL post-training for LLMs",
    python_requires=">=3.11",
    packages=find_packages(include=["megarl", "megarl.*"]),
    include_package_data=True,
    install_requires=install_requires,
    extras_require=extras,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["megarl=megarl.cli.main:main"]},
)
