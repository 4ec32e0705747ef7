"""The `llama_cpp` engine's options, read by the backend (llama_cpp.py) and both runtimes.

Each field says which runtime reads it: `server` (llama_cpp_server.py, a llama-server process),
`library` (llama_cpp_library.py, llama.cpp in kiln's process) or both. Scoring runs in-process
under either runtime (llama_cpp_scoring.py) with the same threads, batch, KV cache type and flash
attention as generation.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field

from kiln.engine.base import EngineConfig


class LlamaCppConfig(EngineConfig):
    backend: Literal["llama_cpp"] = "llama_cpp"
    precision: Literal["f32", "f16", "bf16"] = Field(
        "f32", description="GGUF type when building from an unquantized checkpoint (a gguf artifact keeps its own)")
    runtime: Literal["server", "library"] = Field(
        "server", description="server: a llama-server process kiln streams from over HTTP; library: llama.cpp "
        "in kiln's process, batched by kiln (llama_cpp_library.py): no hop between decode and kiln serve")
    threads: int | None = Field(
        None, ge=1, description="CPU threads llama.cpp decodes with, in both runtimes and in scoring (the server "
        "runtime passes it as llama-server --threads and --threads-batch); None: all cores")
    parallel: int = Field(
        4, ge=1, description="sequences decoded together (continuous batching), in both runtimes: llama-server's "
        "slots (--parallel) or the library runtime's")
    ctx_per_slot: int = Field(2048, ge=16, description="context tokens each slot holds (prompt + output), "
                              "in both runtimes and in scoring")
    batch_size: int = Field(
        512, ge=1, description="prompt tokens per forward step, in both runtimes (llama-server --batch-size; "
        "the library runtime's prefill chunk each step) and in scoring, up to 64 (tokens per decode: each "
        "holds that many rows of logits)")
    # Numerics shared by generation (either runtime) and scoring (in-process): on the tiny f32 Llama the
    # defaults put next-token log-probs up to 1.1e-3 from torch fp32 (flash attention 1.1e-3, f16 cache
    # 3e-4); f32 + off gives 3e-6.
    cache_type: Literal["f16", "f32"] = Field(
        "f16", description="KV cache type, in both runtimes and in scoring (llama-server's default: f16)")
    flash_attn: Literal["auto", "on", "off"] = Field(
        "auto", description="flash attention, in both runtimes and in scoring (auto: on for CPU)")
    startup_timeout_s: float = Field(
        120, gt=0, description="server runtime only: seconds llama-server has to answer /health after it "
        "starts (the library runtime loads in kiln's process and does not read it)")

    def thread_count(self) -> int:
        """`threads`, or every core of this machine when it is None."""
        return self.threads or os.cpu_count() or 1
