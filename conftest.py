"""Rootdir conftest: requests the turbospark conformance harness for every test tree of this repository.

The harness (``turbospark_core.testing``: the ``FamilyConformance`` classes, the
``turbospark_fixtures`` / ``turbospark_install`` fixtures and the
``--turbospark-fixtures`` option) loads only where asked for, so a pytest run
elsewhere on the machine imports neither mlx nor the BLAS shim. pytest honours
``pytest_plugins`` only in the rootdir conftest, hence here for ``tests/``,
``plugins/*/tests`` and ``examples/*/tests`` alike.
"""

import os

pytest_plugins = ["turbospark_core.testing"]

# Which kernel multiplies a quantized layout is chosen by measured speed in real use
# (turbospark_core.kernel_speed); the tests pin the native kernels, so that what a test
# checks never depends on how loaded the machine running it is.
os.environ.setdefault("TURBOSPARK_KERNEL_CHOICE", "native")
