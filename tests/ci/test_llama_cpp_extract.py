"""The llama.cpp build unpacks its source the same way on every Python kiln supports: with tarfile's
"data" filter where it exists (3.11.4+), and on Debian 12's python3 (3.11.2), which `make` runs the build
with where pyenv is absent, by refusing what that filter would: a link, or a path that leaves the folder.
Before, `make demo` stopped there with `TypeError: ... unexpected keyword argument 'filter'`."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from kiln.core import llama_cpp_build


def _archive(tmp_path: Path, *extra: tarfile.TarInfo) -> Path:
    path = tmp_path / "src.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        files = (("pkg/vendor/llama.cpp/CMakeLists.txt", b"project(x)\n"), ("pkg/llama_cpp/__init__.py", b""))
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isfile() else None)
    return path


def _unpack(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tar:
        llama_cpp_build._extract(tar, tar.getmembers(), dest)


@pytest.mark.parametrize("tarfile_", ["as this Python has it", "without a data filter (Python 3.11.2)"])
def test_the_source_is_unpacked_with_or_without_tarfiles_filter(tmp_path, monkeypatch, tarfile_):
    if tarfile_.startswith("without"):
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    _unpack(_archive(tmp_path), tmp_path / "out")
    assert (tmp_path / "out/pkg/vendor/llama.cpp/CMakeLists.txt").read_bytes() == b"project(x)\n"
    assert (tmp_path / "out/pkg/llama_cpp/__init__.py").exists()


@pytest.mark.parametrize("kind", ["escape", "link"])
def test_without_the_filter_a_member_outside_the_folder_or_a_link_is_refused(tmp_path, monkeypatch, kind):
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    bad = tarfile.TarInfo("pkg/../../evil.txt" if kind == "escape" else "pkg/llama_cpp/link")
    if kind == "escape":
        bad.size = 1
    else:
        bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(SystemExit, match="not a plain file or folder inside the archive"):
        _unpack(_archive(tmp_path, bad), tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "out").exists()
