"""Same weights, same bytes: a quantized artifact's sha256 keys every stage after it, so quantizing
one checkpoint twice with one config must give byte-identical files (torchao's serializer alone
does not: its metadata key order changes from one save to the next)."""

from __future__ import annotations

import json
import os
import struct

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


def test_a_hardlinked_file_is_left_alone(tmp_path):
    import torch

    src = tmp_path / "src.safetensors"
    save_file({"w": torch.zeros(3)}, str(src), metadata={"b": "1", "a": "2"})
    (tmp_path / "out").mkdir()
    os.link(src, tmp_path / "out" / "model.safetensors")
    canonicalize_safetensors(tmp_path / "out")
    assert os.stat(src).st_nlink == 2  # still one file shared with the source
