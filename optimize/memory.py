"""Memory budget before loading: will this step fit, from config.json alone?

A quantization run that dies of out-of-memory after ten minutes, or a serving config whose KV
cache cannot fit, should be refused up front with the numbers. The plan has two steps:

- quantize: what the method holds while it works (each method states its own working set,
  e.g. GPTQ's model weights, per-layer Hessians and calibration activations);
- serve: the quantized weights plus the KV cache,
  2 × layers × KV heads × head dim × bytes per element per token, × context × batch.

Free memory is `psutil.virtual_memory().available` on CPU, CUDA's free memory on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kiln.optimize.architecture import DecoderShapes, quantized_linears
from kiln.core.errors import DoesNotFit

# Resident size of the libraries alone, measured on import (Python 3.11, torch 2.13 CPU): every
# CPU step pays this before it loads a byte of model.
RUNTIME_BYTES = {"torch + transformers": 467 << 20, "torch + transformers + gptqmodel": 595 << 20,
                 # kiln run's own process when a stage starts: those libraries, MLflow, the engines' (llama.cpp,
                 # OpenVINO), and what a run keeps (tokenizers, prompts, token ids): bench/scale.py's start
                 # figures for the build stages, 0.68-0.75 GiB at 135M, 1B and 3B (2026-12-05).
                 "kiln run": 768 << 20,
                 # ... and when a quality or benchmark stage starts: what the engine stages left loaded (the
                 # libraries of OpenVINO's export, NNCF's among them, and transformers' model code, kept once
                 # imported), the evaluation text's token ids: 0.83 GiB at 135M, 0.89 at 1B, 1.08 at 3B
                 # (bench/scale.py, 2026-12-05). A build stage after OpenVINO's export in the same process
                 # starts there too: 0.88-0.89 GiB at 135M (2026-12-06), against 0.26-0.71 before it.
                 "kiln run, evaluating": 920 << 20}
# engine/hf_torch.py TorchEngineConfig.score_batch_tokens' default: padded tokens per scoring pass.
SCORE_BATCH_TOKENS = 4096
SCORING = "scoring logits (torch)"
DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "fp8": 1.0, "float8_e4m3fn": 1.0, "int8": 1.0}


@dataclass(frozen=True)
class Component:
    name: str
    bytes: float
    formula: str  # how the number was computed, shown in the table
    per_token: float = 0.0  # the KV cache: bytes per token of context (every sequence of the batch)


@dataclass(frozen=True)
class MethodMemory:
    """What a quantization method states about itself (see each plugin's `memory`)."""

    working_set: list[Component]  # empty when the method loads nothing (the baseline)
    serving_weights: Component
    serving_dtype: str = "float32"  # the KV cache defaults to this when serving
    device: str = "cpu"  # where the method works: "cuda:0" for GPU-only methods


@dataclass(frozen=True)
class StepPlan:
    step: str
    components: tuple[Component, ...]

    @property
    def total(self) -> float:
        return sum(c.bytes for c in self.components)


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    available_bytes: int
    steps: tuple[StepPlan, ...] = field(default_factory=tuple)

    def fits(self) -> bool:
        return all(s.total <= self.available_bytes for s in self.steps)

    def lines(self) -> list[str]:
        out = []
        for s in self.steps:
            out += [f"{s.step:8} {c.name:44} {human(c.bytes):>10}  {c.formula}" for c in s.components]
            out.append(f"{s.step:8} {'total':44} {human(s.total):>10}")
        out.append(f"{'':8} {'available on ' + self.device:44} {human(self.available_bytes):>10}")
        return out

    def check(self) -> None:
        """Raise DoesNotFit, with every component, when a step needs more than is available."""
        if not self.fits():
            worst = self.worst()
            tokens = self.fitting_context()
            fix = (f"A serving context of at most {tokens} tokens fits (the KV cache is what grows). "
                   if tokens else "")
            raise DoesNotFit(
                f"memory: the {worst.step} step needs {human(worst.total)} but {human(self.available_bytes)} "
                f"is available on {self.device}. {fix}Lower optimize.calibration.samples / seq_len, the serving "
                "context or batch, or pick a smaller model or lower precision.", problems=self.lines())

    def worst(self) -> StepPlan:
        """The step that holds the most."""
        return max(self.steps, key=lambda s: s.total)

    def fitting_context(self) -> int | None:
        """The longest serving context (tokens) that fits with everything else as planned; None
        when the plan has no KV cache, or something other than the KV cache already does not fit."""
        serve = next(s for s in self.steps if s.step == "serve")
        kv = next((c for c in serve.components if c.per_token), None)
        if kv is None or any(s.total > self.available_bytes for s in self.steps if s is not serve):
            return None
        tokens = int((self.available_bytes - (serve.total - kv.bytes)) // kv.per_token)
        return tokens if tokens > 0 else None

    def table(self) -> Any:
        """A rich Table of every component, step totals and what is available."""
        from rich.table import Table

        t = Table("step", "component", "bytes", "how", title=f"memory plan ({self.device})")
        for s in self.steps:
            for c in s.components:
                t.add_row(s.step, c.name, human(c.bytes), c.formula)
            style = "red" if s.total > self.available_bytes else "green"
            t.add_row(s.step, "[b]total[/b]", f"[{style}]{human(s.total)}[/{style}]", "", end_section=True)
        t.add_row("", "available", human(self.available_bytes), self.device)
        return t

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "available_bytes": self.available_bytes, "fits": self.fits(),
                "steps": {s.step: {"total_bytes": s.total, "components": {c.name: c.bytes for c in s.components}}
                          for s in self.steps}}


def weights(shapes: DecoderShapes, bytes_per_param: float, dtype: str) -> Component:
    """All parameters at one precision: the unquantized model."""
    return Component(f"weights ({dtype})", shapes.param_count * bytes_per_param,
                     f"{shapes.param_count / 1e6:.1f}M params × {bytes_per_param:g} B")


def quantized_weights(shapes: DecoderShapes, skip: list[str], bits: float, group: int,
                      per_group_bytes: float, other_bytes: float) -> Component:
    """Linears at `bits` plus per-group scale/zero bytes; everything else at `other_bytes` per param."""
    q_params = groups = 0
    for _, lin in quantized_linears(shapes, skip):
        q_params += lin.params
        groups += lin.out_features * (lin.in_features // group if group > 0 else 1)
    other = shapes.param_count - q_params
    total = q_params * bits / 8 + groups * per_group_bytes + other * other_bytes
    scales = f" + {groups / 1e3:.0f}k groups × {per_group_bytes:g} B" if per_group_bytes else ""
    return Component("weights (quantized)", total,
                     f"{q_params / 1e6:.1f}M × {bits:g} bit{scales} + {other / 1e6:.1f}M other × {other_bytes:g} B")


def runtime(libraries: str) -> Component:
    how = "its process when a stage starts, measured" if libraries.startswith("kiln run") else \
        "resident size after import, measured"
    return Component(f"runtime ({libraries})", RUNTIME_BYTES[libraries], how)


def human(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def available_memory(device: str = "cpu") -> int:
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return 0
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def source_dtype(model_config: dict[str, Any]) -> str:
    name = str(model_config.get("dtype") or model_config.get("torch_dtype") or "float32")
    return name if name in DTYPE_BYTES else "float32"


def plan_memory(model_config: dict[str, Any], method_config: Any = None, *, context: int = 0, batch: int = 1,
                kv_dtype: str | None = None, device: str | None = None,
                available_bytes: int | None = None, engine_dtype: str | None = None) -> MemoryPlan:
    """Plan the quantize and serve steps of `method_config` (None: the unquantized model).

    `context` tokens × `batch` sequences size the KV cache (0: weights only). `kv_dtype` defaults
    to the dtype the method serves in, `device` to where the method works (CPU, or GPU 0 for
    the ModelOpt methods), `available_bytes` to what is free there now. `engine_dtype`: the dtype a
    torch engine loads an unquantized checkpoint in (its engine.dtype: float32 unless set), which
    is what it holds, whatever the checkpoint stores.
    """
    from kiln.optimize.base import QUANTIZERS

    shapes = DecoderShapes.from_config(model_config)
    src = source_dtype(model_config)
    method = QUANTIZERS.get(method_config.method if method_config is not None else "none")
    mem: MethodMemory = method.memory(shapes, method_config, src)  # type: ignore[attr-defined]
    if engine_dtype in DTYPE_BYTES and getattr(method_config, "method", "none") == "none":  # the checkpoint as it is
        mem = replace(mem, serving_weights=weights(shapes, DTYPE_BYTES[engine_dtype], engine_dtype),
                      serving_dtype=engine_dtype if engine_dtype in ("float32", "bfloat16", "float16")
                      else mem.serving_dtype)  # int8 weights (OpenVINO's) keep a 16-bit KV cache
    steps = []
    if mem.working_set:
        steps.append(StepPlan("quantize", tuple(mem.working_set)))
    serve = [mem.serving_weights]
    if context > 0:
        kv = kv_dtype or mem.serving_dtype
        if kv not in DTYPE_BYTES:
            raise ValueError(f"kv_dtype {kv!r}: expected one of {', '.join(DTYPE_BYTES)}")
        per_token = shapes.kv_bytes_per_token(DTYPE_BYTES[kv])
        serve.append(Component(f"KV cache ({kv}, {context} tokens × {batch})", per_token * context * batch,
                               f"2 × {shapes.layers} layers × {shapes.kv_heads} KV heads × {shapes.head_dim} "
                               f"head dim × {DTYPE_BYTES[kv]:g} B = {human(per_token)}/token",
                               per_token=per_token * batch))
    steps.append(StepPlan("serve", tuple(serve)))
    device = device or mem.device
    if available_bytes is None:
        available_bytes = available_memory(device)
    return MemoryPlan(device=device, available_bytes=int(available_bytes), steps=tuple(steps))


def larger(a: tuple[Component, ...], b: tuple[Component, ...]) -> tuple[Component, ...]:
    """The one of two sets of components that holds more bytes (`b` on a tie)."""
    return a if sum(c.bytes for c in a) > sum(c.bytes for c in b) else b


# What OpenVINO's build holds beside the compressed model it writes (the IR's bytes, the engine step's weights)
# while it traces and compresses a checkpoint it keeps as stored (its pages dropped behind as they are read).
# Measured with the build alone in a process whose imports were loaded first (bench/openvino_export.py, AMD
# EPYC, 2026-12-06, the tenth round), the build's peak above its start less the IR: 0.55, 1.22, 1.29 and
# 0.30 GiB at 135M, 1B, 3B and 8B. The three with a tied embedding hold more; 8B's untied one, though the
# largest weight of the four, does not. Planned: the tied embedding in float32 + 400 MiB, 0.91-1.13 of those
# builds. (The ninth round fitted "the IR again + 400 MiB" to the engine stages' peaks, which at 1B and 3B
# were the parity reference's bf16 checkpoint, twice an int8 IR: at 8B that planned the build at 1.97x.)
EXPORT_FIXED_BYTES = 400 << 20


def export_held(shapes: DecoderShapes, model_config: dict[str, Any], dtype: str) -> tuple[Component, ...]:
    """What OpenVINO's build holds beside the compressed model it writes: the checkpoint widened to `dtype`
    (the exact float32 IR of a 16-bit checkpoint), else, the checkpoint kept as stored and read once, the
    trace's and NNCF's working set, and a tied embedding's weight in float32."""
    if dtype != source_dtype(model_config):
        return checkpoint_held(shapes, model_config, dtype, f"export: the checkpoint in {dtype}",
                                "shared by the traced graph")
    tied = shapes.vocab * shapes.hidden * 4 if shapes.tied_embeddings else 0
    why = (f"the tied embedding ({shapes.vocab} × {shapes.hidden}) in float32 {human(tied)} + " if tied else "") + \
        f"{human(EXPORT_FIXED_BYTES)}; the checkpoint's pages dropped behind as they are read"
    return (Component("export: the trace and the compression", tied + EXPORT_FIXED_BYTES, why),)


def checkpoint_held(shapes: DecoderShapes, model_config: dict[str, Any], dtype: str, name: str,
                     why: str) -> tuple[Component, ...]:
    """The checkpoint loaded in `dtype`, and its pages as stored, mapped while it loads, where that differs."""
    size, stored = DTYPE_BYTES.get(dtype, 4.0), source_dtype(model_config)
    held = (Component(name, shapes.param_count * size, f"{shapes.param_count / 1e6:.1f}M params × {size:g} B, {why}"),)
    if stored == dtype:
        return held
    return (*held, Component("checkpoint pages it reads", shapes.param_count * DTYPE_BYTES[stored],
                             f"{shapes.param_count / 1e6:.1f}M params × {DTYPE_BYTES[stored]:g} B, mapped while it loads"))


def parse_bytes(text: str) -> int:
    """'24G', '512M', '1.5T', '24GiB', '1000' (bytes) -> bytes; K, M, G, T are powers of 1024."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r}: give a size such as 24G, 512M or 1.5T (powers of 1024)")
    return int(float(m[1]) * 1024 ** " KMGT".index(m[2].upper() or " "))


def arms_table(plans: dict[str, tuple[str, MemoryPlan]]) -> Any:
    """One line per arm (name -> (what it is, its plan)): each step's total, what is available
    where the arm works, and whether it fits."""
    from rich.table import Table

    named = {s.step for _, p in plans.values() for s in p.steps}
    order = ("quantize", "serve", "reference", "engine", "quality", "benchmark")  # as a run takes them
    steps = [k for k in order if k in named] + sorted(named - set(order))
    t = Table("arm", "optimize → engine", *steps, "available", "fits", title="memory plan per arm")
    for name, (what, plan) in plans.items():
        totals = {s.step: s.total for s in plan.steps}
        cells = [f"[{'red' if totals[k] > plan.available_bytes else 'green'}]{human(totals[k])}[/]"
                 if k in totals else "—" for k in steps]
        t.add_row(name, what, *cells, f"{human(plan.available_bytes)} ({plan.device})",
                  "[green]yes[/green]" if plan.fits() else "[red]no[/red]")
    return t


def check_arms(plans: dict[str, tuple[str, MemoryPlan]], fields: dict[str, str], first: str = "") -> None:
    """Raise DoesNotFit naming every arm that does not fit, the step and numbers, and for each the
    recipe change that fits it. `fields`: arm -> where the recipe sets it (candidates.2, baseline).
    `first`: a change to make before any other (the caller knows the recipe), said first."""
    over = {name: plan for name, (_, plan) in plans.items() if not plan.fits()}
    if not over:
        return
    fixes, problems = [], []
    for name, plan in over.items():
        worst = plan.worst()
        fixes.append(f"{name}: the {worst.step} step needs {human(worst.total)} but {human(plan.available_bytes)} "
                     f"is available on {plan.device}; {_fix(name, plan, fields)}")
        problems += [f"{name}: {line}" for line in plan.lines()]
    raise DoesNotFit(f"memory: {len(over)} of {len(plans)} arms do not fit. {first}" + "; ".join(fixes) + ".",
                     problems=problems)


def _fix(name: str, plan: MemoryPlan, fields: dict[str, str]) -> str:
    """The recipe change that fits `plan`'s worst step, or why none does."""
    worst, tokens, free = plan.worst(), plan.fitting_context(), plan.available_bytes
    if tokens:
        return f"fits with a serving context of at most {tokens} tokens (--context {tokens})"
    if worst.step == "reference":
        return ("the engine's parity check loads the checkpoint on torch as it is stored: the checkpoint itself "
                "does not fit; a machine with more memory, or a smaller model")
    scoring = next((c for c in worst.components if c.name == SCORING), None)
    if worst.step == "quality" and scoring is not None and worst.total - scoring.bytes < free:
        fit = int((free - (worst.total - scoring.bytes)) // scoring.per_token) // 64 * 64
        if fit >= 64:
            return (f"the torch scoring pass holds {human(scoring.bytes)} of logits: it fits with the torch "
                    f"engine's score_batch_tokens (baseline.engine for a torch baseline) at most {fit}")
    if worst.step == "benchmark":
        return (f"the benchmark stages hold the baseline's engine beside this arm's in one process, "
                f"and both do not fit in {human(free)}: remove it from `candidates` ({fields.get(name, name)}), "
                f"or run it where {human(worst.total)} is free (a machine, or search.executor: ray nodes)")
    if name == "baseline":
        return "the checkpoint itself does not fit: a machine with more memory, or a smaller model"
    return f"remove it from `candidates` ({fields.get(name, name)}), or pick a method that holds less"
