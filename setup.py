"""Build the optional native parts (see turbospark_core/blas.py and turbospark_core/native.py).

Metadata lives in pyproject.toml. Both extensions are optional: when one cannot
be built, the install still succeeds and the runtime says which path it uses
(``turbospark inspect``).
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

QMM_DIR = Path(__file__).parent / "turbospark_core" / "_native" / "qmm"


class CMakeExtension(Extension):
    """An extension whose sources are built by CMake (``sourcedir`` holds CMakeLists.txt)."""

    def __init__(self, name: str, sourcedir: Path) -> None:
        super().__init__(name, sources=[])
        self.sourcedir = str(sourcedir.resolve())


class BuildExt(build_ext):
    """build_ext that also drives CMake, and never fails the install for an optional extension."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        try:
            self._build_cmake(ext)
        except (OSError, subprocess.CalledProcessError) as err:
            print(f"warning: the native quantized kernels were not built ({err}); "
                  f"turbospark will unpack quantized weights instead", file=sys.stderr)

    def _build_cmake(self, ext: CMakeExtension) -> None:
        out = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build = Path(self.build_temp).resolve() / ext.name
        build.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}",
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
        ]
        args += [a for a in os.environ.get("CMAKE_ARGS", "").split() if a]
        subprocess.run(["cmake", ext.sourcedir, *args], cwd=build, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", ".", f"-j{jobs}"], cwd=build, check=True)


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
if os.environ.get("TURBOSPARK_BUILD_NATIVE", "1") != "0":
    ext_modules.append(CMakeExtension("turbospark_core._native._qmm", QMM_DIR))

setup(ext_modules=ext_modules, cmdclass={"build_ext": BuildExt})
