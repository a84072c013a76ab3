"""A rank that dies in C++ says why: ``launch``'s failure report keeps what the rank printed before it
died and torchrun's root cause, not only torchrun's own traceback.

torchrun (the oracle here: its real output) follows a failed rank with ~40 lines of its own report
(an ``E...`` log line, its Python traceback, the ChildFailedError block). A plain tail of that
length hid the rank's ``terminate called ...`` line; this is how a rare SIGABRT of a serving rank
at shutdown once reached CI with no cause on record. One real torchrun of two ranks (~5 s).
"""

from __future__ import annotations

import os

from modelcarve.commands.launching.torchrun import Torchrun, launch

CRASH = """
import os, sys, time
if os.environ["RANK"] == "0":
    sys.stderr.write("terminate called after throwing an instance of 'gloo::IoException'\\n")
    sys.stderr.write("  what():  [pair.cc:598] Connection closed by peer [127.0.0.1]:1\\n")
    sys.stderr.flush()
    os.abort()
time.sleep(60)
"""


def test_a_rank_that_aborts_is_reported_with_its_last_words_and_the_root_cause(tmp_path, monkeypatch, capsys):
    (tmp_path / "crashing_rank.py").write_text(CRASH)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = launch(Torchrun(nproc_per_node=2), "crashing_rank", [], timeout_s=30)
    err = capsys.readouterr().err
    assert code != 0
    assert "the ranks' launcher (torchrun) exited with code" in err
    assert "Connection closed by peer" in err, err  # the rank's own last words
    assert "exitcode  : -6" in err and "SIGABRT" in err, err  # torchrun's root cause
    assert "Traceback (most recent call last)" not in err, err  # and not torchrun's traceback


WORKER = """
import os, sys
import torch.distributed as dist
from modelcarve.runtime.train.launch import main

def crash_in_native_code(args):
    if os.environ["RANK"] == "0":
        os.abort()  # what a C++ std::terminate ends in
    dist.barrier()  # the peer, in a collective: it loses contact and says so

sys.exit(main(None, {"crash": crash_in_native_code}))
"""


def test_a_modelcarve_rank_that_aborts_shows_its_python_stacks(tmp_path, monkeypatch, capsys):
    """A rank under launch.main (gloo world up, signals.install run) prints every thread's stack on a fatal
    signal (faulthandler), and the report keeps them: the frame that died is named."""
    (tmp_path / "crashing_worker.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = launch(Torchrun(nproc_per_node=2), "crashing_worker", ["crash", "{}"], timeout_s=30)
    err = capsys.readouterr().err
    assert code != 0
    assert "Fatal Python error: Aborted" in err, err
    assert "in crash_in_native_code" in err, err  # the Python frame the abort came from
    assert "exitcode  : -6" in err, err
