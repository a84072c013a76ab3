"""A half-written or corrupted checkpoint step is never loaded; no pickle on a load path.

Pure file-level checks (runtime/checkpoint/commit.py needs no process group): step directories are
built by ``commit`` itself from a few files, then damaged the ways disks and crashes damage
them (truncation, a flipped byte, a missing file, a save that never committed, an unlisted
file, a broken manifest). The CLI refuses a damaged ``--resume`` target in one line naming the
file, before any rank starts.
"""

import io
import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from modelcarve.runtime.checkpoint import commit as cc
from modelcarve.spec.errors import ModelcarveError

SRC = Path(__file__).resolve().parents[2] / "src"


def _step(root: Path, step: int, payload: bytes = b"x" * 1000) -> Path:
    tmp = cc.prepare_tmp(root, step)
    (tmp / ".metadata").write_bytes(b"meta" + bytes([step]))
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / "__1_0.distcp").write_bytes(payload[::-1] + b"y")
    info = dict(layout=dict(short="TP2"), model="m", model_hash="h", state=dict(data=dict(next_step=step)))
    return cc.commit(tmp, step, info)


def test_commit_is_atomic_and_intact(tmp_path):
    final = _step(tmp_path, 4)
    assert final.name == "step_00000004" and not (tmp_path / "step_00000004.tmp").exists()
    manifest = cc.check_step(final)
    assert manifest["step"] == 4 and set(manifest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert manifest["files"]["__0_0.distcp"]["size"] == 1000
    assert cc.choose_step(tmp_path).step_dir == final


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "bytes, the manifest says"),
    ("flip", "sha256 differs"),
    ("delete", "missing"),
    ("extra", "not listed in the manifest"),
    ("manifest", "not valid JSON"),
])
def test_damaged_newer_step_is_skipped_and_named(tmp_path, damage, reason):
    good = _step(tmp_path, 2)
    bad = _step(tmp_path, 4)
    victim = bad / "__1_0.distcp"
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-7])
    elif damage == "flip":
        data = bytearray(victim.read_bytes())
        data[10] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "delete":
        victim.unlink()
    elif damage == "extra":
        victim = bad / "__2_0.distcp"
        victim.write_bytes(b"planted")
    else:
        victim = bad / "manifest.json"
        victim.write_text('{"format": "modelcarve-dcp-1", "step": 4,')
    choice = cc.choose_step(tmp_path)
    assert choice.step_dir == good and choice.step == 2
    assert len(choice.skipped) == 1 and victim.name in choice.skipped[0] and reason in choice.skipped[0]
    assert "step_00000002" in choice.describe() and victim.name in choice.describe()
    with pytest.raises(cc.DamagedCheckpoint) as err:  # named directly: refused, naming the file
        cc.choose_step(bad)
    assert err.value.file == victim.name and reason in str(err.value)


def test_half_written_step_is_never_loaded(tmp_path):
    good = _step(tmp_path, 2)
    tmp = cc.prepare_tmp(tmp_path, 4)  # a save that died before its commit (no manifest, .tmp name)
    (tmp / "__0_0.distcp").write_bytes(b"partial")
    choice = cc.choose_step(tmp_path)
    assert choice.step_dir == good and "step_00000004.tmp" in choice.skipped[0] and "half-written" in choice.skipped[0]
    with pytest.raises(cc.DamagedCheckpoint, match="half-written"):
        cc.choose_step(tmp)
    only_tmp = tmp_path / "other"
    cc.prepare_tmp(only_tmp, 3)
    with pytest.raises(ModelcarveError, match="no intact checkpoint step"):
        cc.choose_step(only_tmp)


def test_keep_prunes_oldest(tmp_path):
    for s in (2, 4, 6):
        _step(tmp_path, s)
    removed = cc.prune(tmp_path, 2)
    assert [p.name for p in removed] == ["step_00000002"]
    assert [s for s, _ in cc.committed_steps(tmp_path)] == [6, 4]


def _cli(*argv):
    import os

    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-m", "modelcarve.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=300)


def test_cli_refuses_damaged_resume_in_one_line(tmp_path):
    bad = _step(tmp_path, 4)
    (bad / "__0_0.distcp").write_bytes(b"short")
    proc = _cli("run", "--model", "tiny-llama", "--layout", "dp=2,gbs=4,seq=16", "--steps", "6", "--resume", str(bad))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "__0_0.distcp" in lines[0] and "damaged" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _cli("run", "--model", "tiny-llama", "--layout", "dp=2,gbs=4,seq=16", "--save-every", "2")
    assert proc.returncode == 2 and "--checkpoint-dir" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_metadata_unpickler_refuses_code(tmp_path):
    """DCP's .metadata is a pickle: ours is read by a restricted unpickler that builds no callable."""
    from modelcarve.runtime.checkpoint.dcp import _MetadataUnpickler

    class Evil:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(tmp_path / "pwned")],))

    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        _MetadataUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()
    assert not (tmp_path / "pwned").exists()


def test_no_unsafe_load_in_src():
    """No pickle on a load path: every torch.load passes weights_only=True, no pickle.load of a file
    and no np.load(allow_pickle=True). (pickle.loads of bytes one rank broadcast to its peers, as
    torch's own broadcast_object_list does, is inter-process messaging within one job, not a load.)"""
    offenders = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for m in re.finditer(r"torch\.load\(", text):
            depth, i = 1, m.end()
            while depth and i < len(text):
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            if "weights_only=True" not in text[m.end():i]:
                offenders.append(f"{path.relative_to(SRC)}: torch.load without weights_only=True")
        for m in re.finditer(r"pickle\.load\(|np\.load\([^)]*allow_pickle=True", text):
            offenders.append(f"{path.relative_to(SRC)}: {m.group(0)}")
    assert not offenders, offenders
    # the check itself can fail: a planted call is caught
    planted = "x = torch.load(f, map_location='cpu')"
    assert "weights_only=True" not in planted and re.search(r"torch\.load\(", planted)


def test_manifest_is_json(tmp_path):
    final = _step(tmp_path, 1)
    assert json.loads((final / "manifest.json").read_text())["format"] == cc.FORMAT
