"""Jane Austen's novels from Debian's `r-cran-janeaustenr`, read without R.

The package stores each novel as an R character vector (one element per printed line) in an R
lazy-load database: `Rdata.rdx` is a gzipped serialized index of (offset, length) per object,
and each object in `Rdata.rdb` is a 4-byte big-endian length followed by a zlib stream of a
serialized R object. PyPI `rdata` parses the serialized objects.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import tempfile
import zlib
from pathlib import Path

from kiln.core.errors import BadInput
from kiln.core.files import atomic_dir

PACKAGE = "r-cran-janeaustenr"
BOOKS = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


def fetch_janeaustenr(debs: Path) -> Path:
    """The .deb and its extracted tree (under `root/`) in `debs/<package>`, downloaded once."""
    final = Path(debs) / PACKAGE
    if final.is_dir():
        return final
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # lets apt's sandbox user `_apt` write there (else apt warns)
        _apt_download(Path(tmp))
        deb = next(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        with atomic_dir(final) as scratch:
            shutil.copy2(deb, scratch / deb.name)
            _run(["dpkg", "-x", str(deb), str(scratch / "root")])
    return final


def read_novels(package_dir: Path) -> dict[str, list[str]]:
    """Every novel in the package, as the list of its printed lines."""
    import rdata

    rdx = next(Path(package_dir).rglob("janeaustenr/data/Rdata.rdx"), None)
    if rdx is None:
        raise RuntimeError(f"{package_dir} holds no janeaustenr/data/Rdata.rdx: not the expected package")
    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(rdx.read_bytes()), extension=".rds"))
    compressed = index["compressed"]
    if compressed.dtype != bool or not compressed[0]:
        # R writes compress=2/3 (bzip2/xz) with an extra type byte; this package uses zlib.
        raise RuntimeError(f"{rdx}: unsupported lazy-load compression {compressed!r}")
    blob = rdx.with_suffix(".rdb").read_bytes()
    novels = {}
    for name in BOOKS:
        offset, length = (int(x) for x in index["variables"][name])
        entry = blob[offset : offset + length]
        raw = zlib.decompress(entry[4:])
        if len(raw) != int.from_bytes(entry[:4], "big"):
            raise RuntimeError(f"{rdx.with_suffix('.rdb')}: entry {name!r} is corrupt")
        lines = rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))
        novels[name] = ["" if line is None else str(line) for line in lines]
    return novels


def _apt_download(into: Path) -> None:
    """`apt-get download` the package; refresh apt's lists once if they do not know it."""
    try:
        result = _run(["apt-get", "download", PACKAGE], cwd=into, check=False)
    except FileNotFoundError:
        raise BadInput(f"demo data: needs apt-get and dpkg (Debian/Ubuntu) to fetch {PACKAGE}. "
                       "Run kiln's demo on Debian or Ubuntu, or pass your own data files.") from None
    if result.returncode == 0:
        return
    if "Unable to locate package" in result.stderr or "no installation candidate" in result.stderr:
        if os.geteuid() != 0:
            raise BadInput(f"demo data: apt does not know {PACKAGE} (package lists missing). "
                           "Run: sudo apt-get update, then run kiln again.")
        _run(["apt-get", "update"])
        result = _run(["apt-get", "download", PACKAGE], cwd=into, check=False)
    if result.returncode != 0:
        raise BadInput(f"demo data: `apt-get download {PACKAGE}` failed (it needs the Debian mirror): "
                       f"{result.stderr.strip()[-500:]}")


def _run(cmd: list[str], cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()[-500:]}")
    return result
