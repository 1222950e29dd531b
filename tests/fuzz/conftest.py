"""Seeds for the fuzz tests: installs converted once per session from the reference fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from .targets import Seeds, smollm2_path

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"


@pytest.fixture(scope="session")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> Seeds:
    import os

    fixtures = Path(os.environ.get("TURBOSPARK_FIXTURES", FIXTURES))
    if not (fixtures / "llama" / "config.json").is_file():
        pytest.skip(f"reference fixtures {fixtures} are not available")
    return Seeds.make(fixtures, tmp_path_factory.mktemp("fuzz"), smollm2_path())
