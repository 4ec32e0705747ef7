"""Same weights, same bytes: a quantized artifact's sha256 keys every stage after it, so quantizing
one checkpoint twice with one config must give byte-identical files (torchao's serializer alone
does not: its metadata key order changes from one save to the next)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from kiln.optimize.base import QUANTIZERS
from kiln.optimize.checkpoint import canonicalize_safetensors, read_header
from kiln.core.files import sha256_file, sha256_tree


def test_int8_weight_only_twice_gives_the_same_bytes(tiny_llama, tmp_path, reload):
    quantizer = QUANTIZERS.create(QUANTIZERS.config("int8_weight_only")())
    hashes = []
    for i in range(2):
        out = tmp_path / f"q{i}"
        quantizer.quantize(tiny_llama, out, None)
        canonicalize_safetensors(out)
        hashes.append(sha256_tree(out))
    assert hashes[0] == hashes[1]
    reload(tmp_path / "q0")  # still a checkpoint transformers + torchao load


def test_canonical_header_keeps_tensors_and_metadata(tmp_path):
    import torch

    tensors = {"b": torch.arange(6, dtype=torch.float32).reshape(2, 3), "a": torch.ones(5, dtype=torch.int8)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"z": '{"k": 1}', "a": "x"})
    before = read_header(path)
    # The same header with its keys in another order, as a second save may write it.
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        data = f.read()
    shuffled = json.dumps(dict(reversed(list(before.items())))).encode()
    shuffled += b" " * (-len(shuffled) % 8)
    other = tmp_path / "other" / "model.safetensors"
    other.parent.mkdir()
    other.write_bytes(struct.pack("<Q", len(shuffled)) + shuffled + data)
    assert sha256_file(path) != sha256_file(other)
    for p in (path, other):
        canonicalize_safetensors(p.parent)
    assert sha256_file(path) == sha256_file(other)
    assert read_header(path) == before
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + n) % 8 == 0  # tensor data stays 8-byte aligned
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def _with_header(path: Path, header: bytes) -> None:
    """Rewrite `path` with `header` (padded) in place of its own, the tensor bytes unchanged."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        data = f.read()
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("spacing", ["reordered", "spaced"])
def test_a_file_with_a_second_name_is_replaced_never_written_through(tmp_path, spacing):
    """Canonicalizing never writes through a hardlink: another name for the old bytes keeps them,
    whether the canonical header has the same length (rewritten in place when the file has one
    name) or not. The pass-through used to hardlink the user's weights and relied on being skipped
    here; it copies now (issue 52), and nothing is skipped."""
    import torch

    src = tmp_path / "src.safetensors"
    save_file({"w": torch.zeros(3), "a": torch.ones(2)}, str(src))
    header = read_header(src)
    reordered = {k: dict(reversed(list(v.items()))) for k, v in reversed(list(header.items()))}
    _with_header(src, json.dumps(reordered, separators=(",", ":")).encode() if spacing == "reordered"
                 else json.dumps(header, indent=1).encode())
    before = src.read_bytes()
    (tmp_path / "out").mkdir()
    os.link(src, tmp_path / "out" / "model.safetensors")
    canonicalize_safetensors(tmp_path / "out")
    assert src.read_bytes() == before and os.stat(src).st_nlink == 1
    assert (tmp_path / "out" / "model.safetensors").read_bytes() != before
    assert read_header(tmp_path / "out" / "model.safetensors") == header


def test_a_header_of_the_same_length_is_rewritten_in_place(tmp_path):
    """save_pretrained's header holds the canonical keys in another order: the same length, so the
    file (the pass-through's fresh copy of a 500 MB checkpoint) keeps its inode and is not copied."""
    import torch

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(3), "a": torch.ones(2)}, str(path))
    header = read_header(path)
    _with_header(path, json.dumps({k: dict(reversed(list(v.items()))) for k, v in header.items()},
                                  separators=(",", ":")).encode())
    inode, size = path.stat().st_ino, path.stat().st_size
    canonicalize_safetensors(tmp_path)
    assert (path.stat().st_ino, path.stat().st_size) == (inode, size)
    assert read_header(path) == header
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    assert path.read_bytes()[8:8 + n].rstrip(b" ") == canonical
