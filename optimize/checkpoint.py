"""Reading and copying Hugging Face checkpoint folders without loading their weights.

Everything here works on safetensors headers (a JSON table of names, dtypes, shapes and byte
offsets at the front of the file), so counting parameters or measuring bits per weight of a
500 MB checkpoint takes milliseconds. kiln reads safetensors only: a pickle `.bin` file can
run code when loaded.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

from kiln.core.errors import BadInput

# Weight files and their indexes: written by the quantizer, never copied from the source.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_NOT_SIDE_FILES = {"config.json", "kiln-artifact.json", "kiln-source.json"}


def read_config(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise BadInput(f"model.path: {checkpoint} has no config.json; give a Hugging Face checkpoint folder.")
    return json.loads(path.read_text())


def safetensors_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's safetensors files; refuses a folder that holds only pickle weights."""
    checkpoint = Path(checkpoint)
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in checkpoint.iterdir() if p.suffix in (".bin", ".pt", ".pth")] \
            if checkpoint.is_dir() else []
        found = f" (found {', '.join(pickles)}: pickle files can run code when loaded)" if pickles else ""
        raise BadInput(f"model.path: {checkpoint} has no *.safetensors weights{found}. kiln loads "
                       "safetensors only; convert once with save_pretrained(..., safe_serialization=True) "
                       "in a trusted environment.")
    return files


MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


def read_header(path: Path) -> dict[str, Any]:
    """The safetensors JSON header: {name: {dtype, shape, data_offsets}, "__metadata__": {...}}.

    A file that cannot be one (too short, a header longer than the file or than safetensors
    allows, JSON that does not parse, tensor bytes past its end) is refused naming the file:
    reading such a header as it claims to be asked for petabytes, and a truncated file passed
    through unnoticed until a later stage failed to load it."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
        if length is None or length > min(size - 8, MAX_HEADER_BYTES):
            raise BadInput(f"model.path: {path} is not a valid safetensors file (its header claims "
                           f"{length} bytes of a {size}-byte file); re-save or re-download it.")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise BadInput(f"model.path: {path} has a corrupt safetensors header; re-save or re-download it.") from None
    if not isinstance(header, dict):
        raise BadInput(f"model.path: {path} has a corrupt safetensors header; re-save or re-download it.")
    ends = [info["data_offsets"][1] for name, info in header.items()
            if name != "__metadata__" and isinstance(info, dict) and len(info.get("data_offsets", ())) == 2]
    if ends and max(ends) > size - 8 - length:
        raise BadInput(f"model.path: {path} is truncated: its tensors need {max(ends or [0]) + 8 + length} bytes, "
                       f"the file has {size}; re-save or re-download it.")
    return header


def canonicalize_safetensors(checkpoint: Path) -> None:
    """Rewrite each safetensors header in one canonical form (sorted keys, no spaces), tensor bytes
    untouched: the same weights then give the same file. torchao's serializer emits its metadata
    keys in a different order from one save to the next, which changed the artifact's sha256 on
    every re-quantization and so every content key downstream of it.

    The same keys in another order (save_pretrained's and torchao's headers) have the same length: the
    header is rewritten where it stands, a few KB, not the whole file (the pass-through's copy of a
    500 MB checkpoint is not copied twice). A file with a second name (a hardlink) is replaced through
    a new file instead, so that name keeps its bytes, as is a header whose length changes."""
    from kiln.core.files import atomic_copy_with

    for path in safetensors_files(checkpoint):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            raw = f.read(length)
        canonical = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
        canonical += b" " * (-len(canonical) % 8)  # the spec's padding: tensor data stays 8-byte aligned
        if canonical == raw:
            continue
        if len(canonical) == length and path.stat().st_nlink == 1:
            with open(path, "r+b") as f:
                f.seek(8)
                f.write(canonical)
        else:
            atomic_copy_with(path, struct.pack("<Q", len(canonical)) + canonical, skip=8 + length)


def tensors(checkpoint: Path) -> dict[str, dict[str, Any]]:
    """Every tensor in the checkpoint: name -> {dtype, shape, nbytes}."""
    out: dict[str, dict[str, Any]] = {}
    for path in safetensors_files(checkpoint):
        for name, info in read_header(path).items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            out[name] = {"dtype": info["dtype"], "shape": info["shape"], "nbytes": end - start}
    return out


def skipped_weights(checkpoint: Path, expected: list[str], quantized: list[str]) -> dict[str, list[str]]:
    """What a quantizer left at source precision, read from the tensors it saved.

    `expected` are the module names the shape reader predicts (it knows the Llama and GPT-2
    layouts); only those the checkpoint really has are reported, then every other weight matrix
    it holds (a router, a fused projection it did not predict, each routed expert). Routed experts
    are reported apart: transformers builds them as stacked parameters, not Linear modules, so a
    Linear quantizer leaves them all at source precision (saved per expert, or as 3-D tensors).
    Embeddings are not weights a linear quantizer touches and are left out.
    """
    names = tensors(checkpoint)
    modules = {n.rsplit(".", 1)[0] for n in names} | {"lm_head"}  # a tied lm_head stores no tensor
    done = set(quantized)
    skipped = [m for m in expected if m in modules and m not in done]
    listed = set(skipped) | done
    stacked = [n for n, info in names.items() if len(info["shape"]) >= 3]
    matrices = [n.removesuffix(".weight") for n, info in names.items()
                if n.endswith(".weight") and len(info["shape"]) == 2 and "embed" not in n and ".wte" not in n
                and ".wpe" not in n and n.removesuffix(".weight") not in listed]
    experts = stacked + [m for m in matrices if ".experts." in m]  # saved stacked, or one matrix per expert
    return {"skipped_modules": skipped + matrices + stacked, "unquantized_experts": experts}


def param_count(checkpoint: Path) -> int:
    """Number of parameters of an unquantized checkpoint (tied weights are stored, and counted, once)."""
    total = 0
    for info in tensors(checkpoint).values():
        n = 1
        for d in info["shape"]:
            n *= d
        total += n
    return total


def bits_per_weight(checkpoint_dir: Path, source_param_count: int) -> float:
    """Bits on disk per parameter of the source model: all tensor bytes × 8 / parameters.

    Counts everything the checkpoint stores (scales, zero points, group indexes, unquantized
    embeddings and norms), so it is the honest size figure, not the nominal bit width.
    """
    if source_param_count <= 0:
        raise ValueError("source_param_count must be positive")
    total = sum(info["nbytes"] for info in tensors(checkpoint_dir).values())
    return total * 8 / source_param_count


def link_or_copy(src: Path, dst: Path) -> str:
    """Hardlink `src` to `dst` when both lie in kiln's cache, else `copy_file`. Returns which it did.

    The cache's files are never modified in place (a stage or engine is replaced whole), so sharing
    an inode inside it is safe and saves a copy of every weight byte. A file outside it (the user's
    checkpoint, a folder a test or bench script builds into) can be rewritten by anyone: an inode
    shared with it would change the cache's bytes, and what was judged, with no kiln step seeing it.
    """
    from kiln.core.home import kiln_cache

    dst.parent.mkdir(parents=True, exist_ok=True)
    cache = kiln_cache().resolve()
    if Path(src).resolve().is_relative_to(cache) and dst.parent.resolve().is_relative_to(cache):
        try:
            os.link(src, dst)
            return "hardlink"
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
    return copy_file(src, dst)


# ioctl(FICLONE) (linux/fs.h): `dst` shares `src`'s blocks copy-on-write (btrfs, XFS, bcachefs, ...).
_FICLONE = 0x40049409
# What a filesystem, or a pair of them, that cannot clone answers.
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EBADF}


def copy_file(src: Path, dst: Path) -> str:
    """Copy `src` to `dst`, a file of its own: a reflink where the filesystem offers one (the blocks
    are shared until either side writes, so it costs no disk), else a copy of the bytes (in the
    kernel: sendfile). Returns "reflink" or "copy". Either way `dst` is a new inode: writing into
    `src` afterwards, in place or by `cp` over it, leaves `dst`'s bytes as they were."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
            how = "reflink"
        except OSError as e:
            if e.errno not in _NO_CLONE:
                raise
            how = "copy"
    if how == "copy":
        shutil.copyfile(src, dst)
    shutil.copystat(src, dst)
    return how


def copy_side_files(source: Path, out_dir: Path) -> list[str]:
    """Copy tokenizer, chat template and generation config: what a quantizer's save may omit.

    Weight files, config.json and kiln's own manifests are left to the writer. Files the
    quantizer already wrote are kept.
    """
    copied = []
    for p in sorted(Path(source).iterdir()):
        if (not p.is_file() or p.name in _NOT_SIDE_FILES or p.name in _WEIGHT_INDEXES
                or p.name.endswith(_WEIGHT_SUFFIXES) or (out_dir / p.name).exists()):
            continue
        shutil.copy2(p, out_dir / p.name)
        copied.append(p.name)
    return copied


def linear_names(checkpoint: Path, quantized_suffixes: tuple[str, ...]) -> list[str]:
    """Module names whose weights carry one of `quantized_suffixes` (e.g. ".qweight")."""
    names = set()
    for name in tensors(checkpoint):
        for suffix in quantized_suffixes:
            if name.endswith(suffix):
                names.add(name[: -len(suffix)])
    return sorted(names)
