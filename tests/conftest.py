"""The tests mirror the source's packages (tests/spec, plan, runtime, serve, verify, commands); the
shared helpers (dist.py, hf_tiny.py, serve_fixtures.py, engine_cases.py, fuzz_support.py) stay in
tests/ and are importable from every folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
