"""The tests mirror the source's packages (tests/spec, plan, runtime, serve, verify, commands); the
shared helpers (dist.py, hf_tiny.py, serve_fixtures.py, engine_cases.py, fuzz_support.py) stay in
tests/ and are importable from every folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import os

import pytest

FULL_SCALE = "MODELCARVE_FULL_SCALE"


def pytest_configure(config):
    config.addinivalue_line("markers", f"full_scale: a check played at a planner layout's full world size that takes "
                                       f"minutes on one core; runs when {FULL_SCALE}=1, reported as skipped otherwise")
    config.addinivalue_line("markers", "serial: a wall-clock bound that is the requirement itself; `make test` runs "
                                       "these alone, after the two-worker part, with nothing beside them")


def pytest_collection_modifyitems(config, items):
    if os.environ.get(FULL_SCALE) == "1":
        return
    skip = pytest.mark.skip(reason=f"full-scale check of several minutes (rank_programs.py): set {FULL_SCALE}=1 to run it")
    for item in items:
        if "full_scale" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _engine_servers():
    """The engine venvs' check servers (engine_venvs.engine_run) end with the session."""
    yield
    from engine_venvs import close_servers

    close_servers()
