"""Shared by the fuzz suites (tests/test_fuzz_*.py): run ``cli.main`` in-process and hold it to the
bad-input contract, plus the JSON-ish value strategy they mutate files with.

The contract: the exit code is 0, 1 (a plan where nothing qualifies, a failed verify) or 2; any
exception other than argparse's SystemExit escapes (hypothesis reports it with its traceback: that
is the bug); every stderr line is one ``modelcarve:`` line, at most one of them an error, and an
exit 2 has exactly one.
"""

from __future__ import annotations

import contextlib
import io
import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from modelcarve.cli import main

FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])
"""Deterministic (derandomize): the same cases on every CI run, no example database."""


def check_main(argv: list[str], codes=(0, 1, 2)) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse --help inside a sub-parser
            code = exit_.code or 0
    text = err.getvalue()
    lines = [line for line in text.splitlines() if line.strip()]
    assert code in codes, (argv, code, text)
    assert "Traceback" not in text, text
    assert all(line.startswith("modelcarve:") for line in lines), (argv, text)
    errors = [line for line in lines if line.startswith("modelcarve: error")]
    assert len(errors) <= 1, (argv, text)
    if code == 2:
        assert len(errors) == 1, (argv, text)  # (notes of what was derived may precede it)
    return code, out.getvalue(), text


NUMBERS = st.one_of(
    st.integers(-3, 70), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2, 7, 2**31, 2**63 - 1, 10**40]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, 1e-6, 0.5, 1.5, 4.0e12]),
)
STRINGS = st.one_of(st.text(max_size=12), st.sampled_from(["", "x", "nvlink4", "4.0e12", "1e9", "H100", "llama", "silu",
                                                           "\uff12", "a" * 300, "../x", "NaN"]))
JSONISH = st.recursive(
    st.one_of(st.none(), st.booleans(), NUMBERS, STRINGS),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(STRINGS, inner, max_size=3)),
    max_leaves=6,
)
