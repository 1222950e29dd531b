"""Build the optional BLAS shim (see turbospark_core/blas.py); metadata lives in pyproject.toml."""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "turbospark_core._native._blas_shim",
            sources=["turbospark_core/_native/blas_shim.c"],
            libraries=["dl"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
