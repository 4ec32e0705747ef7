"""The parity smoke check every engine build gets: a few greedy prompts against the torch reference.

The built engine decodes the prompts all at once (it batches them, as the server will); the
reference `torch` backend on the same checkpoint decodes them one at a time. Then both score the
prompt plus the reference continuation, position by position. The reference answers first and is
gone before the engine loads (`reference_answers`, then `check_answers`): one model in memory at
a time. It loads the checkpoint in float32 where the build must be exact, else in the dtype the
checkpoint stores (`reference_dtype`). The prompts always
include a one-token prompt and the shortest the tokenizer makes (`with_shortest`): CTranslate2
streamed every other prompt of a batch as "generated" when one prompt had a single token (issue 39),
and prompts of two tokens or more never show it.

An unquantized build (`FULL_PRECISION`: torch float32, ctranslate2 float32, openvino fp32 with
f32 activations and KV cache) must write exactly the reference's greedy tokens, at the engine's
own precision: where the two diverge, the reference's log-prob gap between its token and the
engine's must be within `TIE_TOLERANCE` (a near-tie that summation order may flip), else the
build is refused (`ParityRefused`, exit 4 as any failed build). Quantized builds are never refused
here (their drift is the gate's to judge): their figures are recorded in the engine stage's output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.engine.base import Engine, GenerationRequest
from kiln.core.errors import BadInput, ExitCode, KilnError

PROMPTS = 3
NEW_TOKENS = 8
# Texts whose encodings are the shortest prompts a tokenizer makes: one letter is one token in most
# vocabularies; "" is only the BOS in one that adds it (and nothing in one that does not).
SHORTEST_TEXTS = ("a", "")
# float32 kernels differ in summation order: per-token log-probs agree to ~1e-4 on the demo model
# (tests/engine/parity.py allows 1e-3); a greedy flip inside that gap is a tie, not a defect.
TIE_TOLERANCE = 1e-3

FULL_PRECISION: dict[str, Callable[[dict[str, Any]], bool]] = {
    "torch": lambda c: c.get("dtype") == "float32",
    "ctranslate2": lambda c: c.get("quantization") == "float32",
    "openvino": lambda c: (c.get("weights"), c.get("activations"), c.get("kv_cache_precision")) == ("fp32", "f32", "f32"),
}


class ParityRefused(KilnError):
    """An unquantized engine build that does not reproduce the reference backend's greedy tokens."""

    exit_code = ExitCode.INTERNAL_ERROR


def unquantized(manifest: dict[str, Any], checkpoint_quantized: bool) -> bool:
    """Whether the build should reproduce the float32 reference exactly."""
    rule = FULL_PRECISION.get(manifest["backend"])
    return not checkpoint_quantized and rule is not None and rule(manifest["config"])


def with_shortest(prompts: Sequence[list[int]], tokenizer: Any) -> list[list[int]]:
    """`prompts` and, after them, a one-token prompt (their first token) and the shortest prompts
    `tokenizer` makes from text (`SHORTEST_TEXTS`), each once. A tokenizer that cannot encode text
    (a fake engine's stand-in) adds nothing beyond the one-token prompt."""
    made = [list(tokenizer(t)["input_ids"]) for t in SHORTEST_TEXTS] if callable(tokenizer) else []
    made = [m for m in made if m]
    fewest = min(map(len, made), default=0)
    out = [list(p) for p in prompts]
    for extra in [[prompts[0][0]], *(m for m in made if len(m) == fewest)]:
        if extra not in out:
            out.append(extra)
    return out


def divergence(reference: Engine, prompt: list[int], want: list[int], got: list[int]) -> tuple[int, float | None]:
    """Where an engine's greedy tokens `got` first differ from the reference's `want` for `prompt`:
    (tokens matched before it, the reference's log-prob gap there between its token and the
    engine's). The gap is None where no token differs: equal, or one of them stopped sooner."""
    matched = _matched(want, got)
    if matched == min(len(got), len(want)):
        return matched, None
    lp = np.asarray(reference.next_token_logprobs([list(prompt) + want[:matched]])[0][-1])
    return matched, float(lp[want[matched]] - lp[got[matched]])


def _matched(want: list[int], got: list[int]) -> int:
    return next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def batched_greedy(engine: Engine, prompts: Sequence[list[int]], n: int) -> list[list[int]]:
    """Every prompt submitted before the first step, so the engine decodes them together."""
    ids = [engine.add(GenerationRequest(list(p), n, ignore_eos=True)) for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for event in engine.step():
            out[event.seq_id].append(event.token_id)
    return [out[i] for i in ids]


@dataclass(frozen=True)
class ReferenceAnswers:
    """What the reference says of the smoke prompts, kept so that the engine under test can be
    loaded after the reference is gone (one model in memory at a time): its greedy continuations,
    their per-token log-probs (None: it cannot score) and its log-distribution at every generated
    position (float32 [len(want), vocab] per prompt), where a divergence's gap is read."""

    prompts: list[list[int]]
    want: list[list[int]]
    logprobs: list[np.ndarray] | None
    rows: list[np.ndarray]
    new_tokens: int


def reference_answers(reference: Engine, prompts: Sequence[list[int]], n: int = NEW_TOKENS) -> ReferenceAnswers:
    """The reference's side of the smoke check on `with_shortest(prompts)`: each prompt decoded one
    at a time (no batching to blame), then scored."""
    prompts = with_shortest(prompts, reference.tokenizer)
    want = [batched_greedy(reference, [p], n)[0] for p in prompts]
    pairs = [(list(p), w) for p, w in zip(prompts, want, strict=True)]
    logprobs = _scores(reference, pairs)
    rows = [np.asarray(reference.next_token_logprobs([list(p) + w[:-1]])[0], dtype=np.float32)[len(p) - 1:]
            for p, w in pairs]
    return ReferenceAnswers(prompts, want, logprobs, rows, n)


def _scores(engine: Engine, pairs: list) -> list[np.ndarray] | None:
    """Per-token log-probs of each pair; None for an engine that cannot score (tokens only)."""
    try:
        return [np.asarray(s.token_logprobs) for s in engine.score(pairs)]
    except (NotImplementedError, KilnError):
        return None


def compare(engine: Engine, answers: ReferenceAnswers) -> dict[str, Any]:
    """Per-prompt figures of `engine` against the reference's `answers`: tokens matched before the
    first divergence, the reference's log-prob gap there, and per-token |delta log-prob| of the
    reference continuation; plus the totals."""
    got = batched_greedy(engine, answers.prompts, answers.new_tokens)
    engine.release_generation()  # it only scores from here: one compiled model at a time (OpenVINO)
    mine = _scores(engine, [(list(p), w) for p, w in zip(answers.prompts, answers.want, strict=True)])
    deltas = None if mine is None or answers.logprobs is None else \
        [np.abs(np.subtract(g, r)) for g, r in zip(mine, answers.logprobs, strict=True)]
    rows = []
    for p, g, w, lp, d in zip(answers.prompts, got, answers.want, answers.rows, deltas or [None] * len(got),
                              strict=True):
        matched = _matched(w, g)
        gap = None if matched == min(len(g), len(w)) else float(lp[matched][w[matched]] - lp[matched][g[matched]])
        # A divergence beyond a near-tie, or as many tokens but fewer or more (no token to call a tie).
        defect = gap > TIE_TOLERANCE if gap is not None else g != w
        rows.append({"prompt_tokens": len(p), "matched_tokens": matched, "tie_gap": gap, "defect": defect,
                     "max_abs_logprob": None if d is None else float(d.max()), "reference": w, "engine": g})
    all_d = np.concatenate(deltas) if deltas else None
    n = answers.new_tokens
    return {"prompts": len(rows), "new_tokens": n, "identical": sum(r["matched_tokens"] == n for r in rows) / len(rows),
            "max_abs_logprob": None if all_d is None else float(all_d.max()),
            "mean_abs_logprob": None if all_d is None else float(all_d.mean()),
            "defects": sum(r["defect"] for r in rows),
            "tie_tolerance": TIE_TOLERANCE, "per_prompt": rows}


def check_build(engine: Engine, reference: Engine, prompts: Sequence[list[int]], exact: bool,
                label: str) -> dict[str, Any]:
    """`check_answers` with both engines at hand (the prompts are `with_shortest(prompts)`)."""
    return check_answers(engine, reference_answers(reference, prompts), exact, label)


def check_answers(engine: Engine, answers: ReferenceAnswers, exact: bool, label: str) -> dict[str, Any]:
    """`compare` figures with the verdict: ParityRefused for an unquantized build that is not exact."""
    figures = {**compare(engine, answers), "exact_required": exact}
    if exact and figures["defects"]:
        bad = next(r for r in figures["per_prompt"] if r["defect"])
        why = ("the engine stopped early" if bad["tie_gap"] is None
               else f"reference log-prob gap {bad['tie_gap']:.3g} > tolerance {TIE_TOLERANCE:g}")
        raise ParityRefused(
            f"Engine build refused: {label} is unquantized, so its greedy tokens must equal the float32 torch "
            f"reference's, but {figures['defects']} of {figures['prompts']} smoke prompts diverge (first: a "
            f"{bad['prompt_tokens']}-token prompt at generated token {bad['matched_tokens']}, {why}; max |delta "
            f"log-prob| {figures['max_abs_logprob']}). The backend or its conversion decodes wrongly: serve "
            "this model on engine.backend torch, or report the backend bug with these figures.")
    return figures


def reference_checkpoint(artifact: Path, *sources: Path | str | None) -> Path:
    """The checkpoint the reference loads: the artifact itself when it is Hugging Face safetensors,
    else (a GGUF file, say) the first of `sources`, the unquantized checkpoints it was made from,
    that still holds one. A cached artifact outlives the folder it was made from (a tiny model
    built in a test's temporary folder, a checkpoint moved since): the caller names the run's own
    copy of the source first."""
    artifact = Path(artifact)
    if _is_checkpoint(artifact):
        return artifact
    named = [Path(s) for s in sources if s is not None]
    for source in named:
        if _is_checkpoint(source):
            return source
    tried = ", ".join(str(s) for s in named) or "none recorded"
    raise BadInput(f"{artifact}: not a safetensors checkpoint, and no unquantized source to check it against is left "
                   f"(tried: {tried}). Point model.path at the checkpoint this artifact was made from.")


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def reference_dtype(exact: bool, stored: str) -> str:
    """The dtype the reference loads the checkpoint in: float32 where the build must be exact (it
    is float32 itself), else the dtype the checkpoint stores (a bf16 checkpoint's reference holds
    it once, not twice as float32 would); a quantized build's drift is the gate's to judge."""
    return "float32" if exact or stored not in ("bfloat16", "float16") else stored


def reference_engine(checkpoint: Path, threads: int | None = None, dtype: str = "float32") -> Engine:
    """The reference backend: kiln's torch engine on `checkpoint`, in float32 unless told."""
    from kiln.engine.hf_torch import TorchEngine, TorchEngineConfig

    return TorchEngine(Path(checkpoint), TorchEngineConfig(dtype=dtype, threads=threads))
