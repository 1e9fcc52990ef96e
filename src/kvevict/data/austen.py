"""Jane Austen's six novels from Debian's ``r-cran-janeaustenr`` package (shared DATA.md): an R
lazy-load database (``Rdata.rdx`` index + ``Rdata.rdb`` zlib-compressed serialized objects),
read with PyPI ``rdata`` (the ``eval`` extra). Each novel is a character vector of lines."""

from __future__ import annotations

import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

from ..fetch import cache_dir

PACKAGE = "r-cran-janeaustenr"
DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"


def fetch() -> Path:
    """The package's data folder, downloaded with ``apt-get download`` and unpacked once."""
    dest = cache_dir("packages", "janeaustenr")
    data = dest / DATA_DIR
    if not (data / "Rdata.rdb").exists():
        with tempfile.TemporaryDirectory() as tmp:
            res = subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, capture_output=True, text=True)
            debs = list(Path(tmp).glob("*.deb"))
            if res.returncode != 0 or not debs:
                raise RuntimeError(
                    f"could not download the Debian package {PACKAGE} (run apt-get update?):\n{res.stderr.strip()}"
                )
            subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(dest)], check=True)
    return data


def read_lazyload(rdx: Path, rdb: Path) -> dict[str, object]:
    """name -> converted R object of an R lazy-load database. Each entry of the index's
    ``variables`` is (offset, length) in the .rdb: a 4-byte big-endian length, then zlib data."""
    import warnings

    import rdata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        index = rdata.read_rds(rdx)
    raw = Path(rdb).read_bytes()
    out = {}
    for name, (off, length) in index["variables"].items():
        chunk = raw[int(off) : int(off) + int(length)]
        size = struct.unpack(">I", chunk[:4])[0]
        blob = zlib.decompress(chunk[4:])
        if len(blob) != size:
            raise ValueError(f"{rdb}: entry {name!r} is corrupt (expected {size} bytes, got {len(blob)}).")
        with warnings.catch_warnings():  # rdata cannot tell a bare serialized object's file type
            warnings.simplefilter("ignore", UserWarning)
            out[str(name)] = rdata.conversion.convert(rdata.parser.parse_data(blob, extension=".rds"))
    return out


def lines_to_text(lines) -> str:
    """Join a novel's lines: blank lines separate paragraphs, other line breaks become spaces."""
    paras, cur = [], []
    for line in map(str, lines):
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras)


def austen(data_dir=None) -> list[tuple[str, str]]:
    """(name, text) of the six novels, in the package's order (or of the database in ``data_dir``)."""
    d = Path(data_dir) if data_dir else fetch()
    books = read_lazyload(d / "Rdata.rdx", d / "Rdata.rdb")
    return [(name, lines_to_text(lines)) for name, lines in books.items()]
