"""The on-disk life of a training checkpoint: atomic commit, manifest, integrity, which step to resume.

A checkpoint directory (``run --checkpoint-dir DIR``) holds one sub-directory per saved step::

    DIR/step_00000004/   .metadata  __0_0.distcp  __1_0.distcp ...  manifest.json
    DIR/step_00000006.tmp/          (a save in progress or one that died half-way: never loaded)

Commit protocol (``commit``): the ranks write into ``step_N.tmp`` (torch.distributed.checkpoint
with ``sync_files``), then rank 0 hashes every file, writes ``manifest.json`` (step, layout, model
hash, trainer state, and per file its size and sha256), fsyncs it and the directory, and renames
``step_N.tmp`` to ``step_N`` (atomic on POSIX) and fsyncs ``DIR``. A step directory therefore
exists only once it is complete; a crash at any point leaves at worst a ``.tmp`` directory.

Loading checks before anything is read (``check_step``): the manifest parses and has its fields,
every listed file exists with its size and sha256, and no file the loader would read is unlisted;
the first problem raises ``DamagedCheckpoint`` naming the file. ``choose_step(path)`` takes a step
directory as it is (refused if damaged) or, for ``DIR``, the newest intact step, with one line per
newer step it skipped naming the damaged file. This module imports no torch: the launcher checks
``--resume`` before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from modelcarve.spec.errors import ModelcarveError

MANIFEST = "manifest.json"
FORMAT = "modelcarve-dcp-1"
_STEP_RE = re.compile(r"step_(\d+)")


class DamagedCheckpoint(ModelcarveError):
    """A step directory failed its integrity check; ``file`` is the offending file."""

    def __init__(self, step_dir: Path, file: str, reason: str):
        self.step_dir, self.file, self.reason = Path(step_dir), file, reason
        super().__init__(f"checkpoint {step_dir} is damaged: {file}: {reason}; it is not loaded "
                         f"(resume from DIR to take the newest intact step, or pass another step directory)")


@dataclass
class Choice:
    """The step to resume from and what was skipped on the way."""

    step_dir: Path
    manifest: dict
    skipped: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def describe(self) -> str:
        text = f"resuming from {self.step_dir} (step {self.step})"
        return text + "".join(f"; skipped {s}" for s in self.skipped)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_tmp(root: Path, step: int) -> Path:
    """A fresh, empty ``step_N.tmp`` (rank 0 only; the ranks then write into it)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (step_dir_name(step) + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def commit(tmp: Path, step: int, info: dict) -> Path:
    """Hash, write the manifest, fsync and rename ``tmp`` into place (rank 0, after every rank wrote)."""
    files = {}
    for path in sorted(tmp.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            files[path.name] = dict(size=path.stat().st_size, sha256=sha256_file(path))
    manifest = dict(format=FORMAT, step=step, **info, files=files)
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = tmp.parent / step_dir_name(step)
    if final.exists():  # a restarted job saving the same step again: replace the old copy
        old = tmp.parent / (final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(tmp.parent)
    return final


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every committed step under ``root``, newest first."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_RE.fullmatch(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` committed steps (0: keep all); returns what was removed."""
    if keep <= 0:
        return []
    removed = []
    for _, path in committed_steps(root)[keep:]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def read_manifest(step_dir: Path) -> dict:
    path = step_dir / MANIFEST
    if not path.is_file():
        raise DamagedCheckpoint(step_dir, MANIFEST, "missing (the save never committed)")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise DamagedCheckpoint(step_dir, MANIFEST, f"not valid JSON ({str(err)[:80]})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DamagedCheckpoint(step_dir, MANIFEST, f"not a {FORMAT} manifest")
    for key, kind in (("step", int), ("files", dict), ("layout", dict), ("model_hash", str), ("state", dict)):
        if not isinstance(manifest.get(key), kind):
            raise DamagedCheckpoint(step_dir, MANIFEST, f"field {key!r} is missing or not a {kind.__name__}")
    return manifest


def check_step(step_dir: str | Path) -> dict:
    """The manifest of an intact step directory; DamagedCheckpoint naming the first bad file."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise ModelcarveError(f"checkpoint {step_dir} does not exist or is not a directory")
    manifest = read_manifest(step_dir)
    files = manifest["files"]
    if ".metadata" not in files:
        raise DamagedCheckpoint(step_dir, ".metadata", "not listed in the manifest")
    for name, entry in sorted(files.items()):
        path = step_dir / name
        if "/" in name or name.startswith(".."):
            raise DamagedCheckpoint(step_dir, name, "a manifest entry outside the step directory")
        if not path.is_file():
            raise DamagedCheckpoint(step_dir, name, "missing")
        size = path.stat().st_size
        if size != entry.get("size"):
            raise DamagedCheckpoint(step_dir, name, f"{size} bytes, the manifest says {entry.get('size')} "
                                                    f"(truncated or overwritten)")
        if sha256_file(path) != entry.get("sha256"):
            raise DamagedCheckpoint(step_dir, name, "sha256 differs from the manifest (corrupted)")
    for path in step_dir.iterdir():  # a file the loader would read but nobody vouched for
        if path.is_file() and path.name != MANIFEST and path.name not in files:
            raise DamagedCheckpoint(step_dir, path.name, "not listed in the manifest")
    return manifest


def is_step_dir(path: Path) -> bool:
    return (path / MANIFEST).exists() or bool(_STEP_RE.fullmatch(path.name.removesuffix(".tmp")))


def choose_step(path: str | Path) -> Choice:
    """What ``--resume path`` loads: that step (intact) or the newest intact step under it."""
    path = Path(path)
    if not path.exists():
        raise ModelcarveError(f"--resume {path}: no such checkpoint directory")
    if is_step_dir(path):
        if path.name.endswith(".tmp"):
            raise DamagedCheckpoint(path, MANIFEST, "a half-written save (.tmp directory, never committed)")
        return Choice(path, check_step(path))
    skipped = []
    newest_done = max((s for s, _ in committed_steps(path)), default=-1)
    for tmp in sorted(path.glob("step_*.tmp")):
        m = _STEP_RE.fullmatch(tmp.name.removesuffix(".tmp"))
        if m and int(m.group(1)) > newest_done:
            skipped.append(f"{tmp.name} (half-written: never committed)")
    for _, step_dir in committed_steps(path):
        try:
            return Choice(step_dir, check_step(step_dir), skipped)
        except DamagedCheckpoint as err:
            skipped.append(f"{step_dir.name} (damaged: {err.file}: {err.reason})")
    detail = f" ({'; '.join(skipped)})" if skipped else ""
    raise ModelcarveError(f"--resume {path}: no intact checkpoint step to resume from{detail}; "
                          f"start without --resume or name another directory")


def latest_intact(root: str | Path) -> Choice | None:
    """The newest intact step under ``root``, or None when there is none (auto-resume after a restart)."""
    root = Path(root)
    if not committed_steps(root):
        return None
    try:
        return choose_step(root)
    except ModelcarveError:
        return None
