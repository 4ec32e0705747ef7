"""The engine contract: build an engine from a checkpoint, load it, stream tokens, score.

Every backend is one file in this folder: a pydantic config (its `backend` field is a Literal of
its name) and an `EngineBackend` subclass registered in `BACKENDS`. A built engine is a folder
with `kiln-engine.json` (backend name, config, source artifact hash, library versions, hardware
fingerprint) so `kiln serve ENGINE_DIR` can load it without the recipe.

The `Engine` runtime API is step-based so a server can do continuous batching: requests `add`ed
while others decode join the running batch at the next `step`.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from kiln.core.errors import BadInput
from kiln.core.registry import Registry

MANIFEST = "kiln-engine.json"
REBUILD = ("Engines are built by a run's engine stage: rebuild with `kiln run RECIPE --fresh engine`, "
           "then `kiln serve RUN`.")  # the fix every "this engine folder is broken" message names


class EngineConfig(BaseModel):
    """A backend's config: its knobs. Searching them (the recipe's `tune`) is evaluate/tune.py's."""

    model_config = ConfigDict(extra="forbid")
    backend: str

    def plain_twin(self) -> EngineConfig | None:
        """The same configuration without the levers that claim lossless output (speculative decoding),
        or None when it has none. The exactness check compares a config's greedy text with its twin's,
        and the speed sweep measures where the lever stops paying against it."""
        return None


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    stop_ids: tuple[int, ...] = ()
    temperature: float = 0.0  # 0: greedy
    seed: int | None = None  # 0..2**63-1
    top_p: float = 1.0  # nucleus sampling when temperature > 0: the smallest set of tokens with this mass
    # Report each generated token's log-probability (TokenEvent.logprob). Unasked, an engine may leave
    # it None: llama-server computes a softmax over the whole vocabulary for every token to give it.
    logprobs: bool = False
    # The engine may reuse the KV cache of an earlier request that shared this prompt's prefix (llama-server's
    # prompt cache). A benchmark that sends the same prompts round after round sets False, or the engine that
    # caches reports a time to first token without the prefill the engine that does not cache pays for.
    cache_prompt: bool = True


@dataclass(frozen=True)
class TokenEvent:
    seq_id: int
    token_id: int
    time: float  # time.perf_counter() when the token was produced
    logprob: float | None = None
    finish_reason: str | None = None  # "length" | "stop" on the last token, else None
    # On a sequence's last event, from engines that know them (llama-server's timings): prompt_tokens,
    # cached_tokens (prompt tokens served from the prompt cache), and where the engine speculates
    # draft_tokens and draft_accepted (drafted tokens the model confirmed). None: not known.
    stats: dict[str, int] | None = None


@dataclass(frozen=True)
class Score:
    """Log-likelihood of a continuation given a context (what lm-eval's loglikelihood needs)."""

    logprob: float
    is_greedy: bool
    token_logprobs: tuple[float, ...]


def check_request(request: GenerationRequest, max_positions: int) -> None:
    """What every backend refuses before queueing a request."""
    n = len(request.prompt_ids)
    if n == 0 or request.max_new_tokens < 1:
        raise BadInput("A generation request needs a non-empty prompt and max_new_tokens >= 1.")
    if n >= max_positions:
        raise BadInput(f"Prompt of {n} tokens does not fit the model's {max_positions} positions.")


class Engine(abc.ABC):
    """A loaded engine. Not thread-safe: one scheduler loop drives it (see `readiness_fd`)."""

    tokenizer: Any
    manifest: dict[str, Any]

    @property
    def vocab_size(self) -> int:
        """Token ids this engine accepts are 0..vocab_size-1 (the server refuses others)."""
        return len(self.tokenizer)

    @abc.abstractmethod
    def add(self, request: GenerationRequest) -> int:
        """Queue a request; it joins the running batch at the next `step`. Returns its seq id."""

    @abc.abstractmethod
    def step(self) -> list[TokenEvent]:
        """Advance every active sequence by one token (prefilling new ones first)."""

    @abc.abstractmethod
    def cancel(self, seq_id: int) -> None: ...

    @abc.abstractmethod
    def has_work(self) -> bool: ...

    def readiness_fd(self) -> int | None:
        """For an engine whose tokens are computed elsewhere (a server it reads over sockets): a file
        descriptor that turns readable when `poll` has something to return. The server's event loop
        then watches it and calls `add`, `poll` and `cancel` itself, with no thread in the token's
        path, while `score` and `next_token_logprobs` run on the scheduler thread: such an engine
        keeps generation and scoring apart. None (the default): `step` computes, on that thread."""
        return None

    def poll(self) -> list[TokenEvent]:
        """The tokens that have arrived, without blocking (only engines with a `readiness_fd`).
        Raises, as `step` does, for a sequence that failed or a server silent for too long."""
        raise NotImplementedError(f"{type(self).__name__} computes in step(); it has no readiness_fd")

    @abc.abstractmethod
    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[Score]:
        """Log-likelihood of each continuation (second) given its context (first), batched."""

    @abc.abstractmethod
    def next_token_logprobs(self, ids: Sequence[list[int]]) -> list[Any]:
        """Full next-token log-distributions at every position: one [len, vocab] float array
        per sequence. Token-level agreement (KL, top-1) with the baseline needs all of it."""

    def generate(self, requests: Sequence[GenerationRequest]) -> Iterator[TokenEvent]:
        """Run requests to completion as one batch, yielding tokens as they are produced."""
        for r in requests:
            self.add(r)
        while self.has_work():
            yield from self.step()

    def release_generation(self) -> None:  # noqa: B027 - optional hook
        """Hand back what generating made (a pipeline, its KV cache) once nothing is in flight, for a
        caller that only scores from here on; the next `add` makes it again. Default: nothing to do."""

    def release_scoring(self) -> None:  # noqa: B027 - optional hook
        """Hand back what scoring made (a scorer beside the generation path), for a caller that only
        generates from here on; the next `score` makes it again. Default: nothing to do."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free resources (worker processes, memory)."""


class EngineBackend(abc.ABC):
    """Builds engines of one kind and loads them. Implementations live one per file."""

    name: ClassVar[str]
    # False for backends that compress weights themselves from an unquantized checkpoint (their own
    # precision option): a recipe pairing one with a quantizing optimize method is refused up front.
    takes_quantized: ClassVar[bool] = True
    # Artifact formats `build` reads (a quantizer's `artifact_format`), and whether the engine can
    # score prompts (`score`, `next_token_logprobs`): the recipe is refused up front when not.
    artifact_formats: ClassVar[tuple[str, ...]] = ("safetensors",)
    scores: ClassVar[bool] = True
    # The formats a quantized artifact may come in; None: any of artifact_formats.
    quantized_formats: ClassVar[tuple[str, ...] | None] = None
    # Raised when what the backend's engines generate or score changes with the same build (its
    # adapter code, not a library): part of the engine's cache key, so every stage that measured
    # the old behaviour is measured again. 0 keeps the keys engines had before it existed.
    revision: ClassVar[int] = 0

    def __init__(self, config: EngineConfig):
        self.config = config

    @abc.abstractmethod
    def build(self, checkpoint: Path, out_dir: Path) -> dict[str, Any]:
        """Compile/convert `checkpoint` into an engine in `out_dir`; return manifest fields."""

    @classmethod
    def load(cls, engine_dir: Path, **options: Any) -> Engine:
        """Load a built engine (the folder `build` wrote) ready to serve; `options` override its config
        (runtime settings such as threads) for this load only."""
        manifest = read_manifest(engine_dir)
        config = engine_config({**manifest, "config": {**manifest["config"], **options}})
        engine = cls.open(Path(engine_dir), config, manifest)
        engine.manifest = manifest
        return engine

    @classmethod
    @abc.abstractmethod
    def open(cls, engine_dir: Path, config: Any, manifest: dict[str, Any]) -> Engine:
        """The hook `load` calls: start the engine built in `engine_dir` under `config` (the manifest's
        config with the load's options over it, validated by this backend's config class)."""

    @classmethod
    def refuses(cls, config: dict[str, Any]) -> str | None:
        """Why this backend cannot build a checkpoint whose config.json holds `config`, or None. Asked
        before any stage runs (the pipeline's input check), without importing the backend's
        library: an architecture its converter cannot take is refused in seconds, naming the field."""
        return None


BACKENDS: Registry[EngineBackend] = Registry("engine backend", "backend")
_REQUIRED = ("backend", "config", "source", "versions", "hardware", "build")


def read_manifest(engine_dir: Path) -> dict[str, Any]:
    """The manifest of `engine_dir`, checked for shape; BadInput names the file and the fix."""
    path = Path(engine_dir) / MANIFEST
    if not path.is_file():
        raise BadInput(f"{path} not found: {engine_dir} is not a built engine. {REBUILD}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BadInput(f"{path} is not valid JSON ({e}). {REBUILD}") from e
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise BadInput(f"{path} lacks {', '.join(missing)}. {REBUILD}")
    BACKENDS.get(manifest["backend"])  # unknown backend -> BadInput with "Did you mean"
    return manifest


def engine_config(manifest: dict[str, Any], where: Path | str = MANIFEST) -> EngineConfig:
    """The manifest's backend config, validated by the backend's own config class."""
    try:
        return TypeAdapter(BACKENDS.config_union()).validate_python(manifest["config"])
    except ValidationError as e:
        problems = [f"config.{'.'.join(map(str, x['loc'][1:] or x['loc']))}: {x['msg']}" for x in e.errors()]
        raise BadInput(f"{where}: invalid engine config. {REBUILD}", problems) from e


# What an engine folder keeps of its checkpoint beside the weights: the tokenizer, its config, the model config.
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")


def keep_checkpoint_files(checkpoint: Path, out_dir: Path) -> None:
    """The checkpoint's tokenizer and config files in the engine's folder, hard-linked when both are in
    kiln's cache (the cache holds their bytes once, issue 35), else copied (`link_or_copy`)."""
    from kiln.optimize.checkpoint import link_or_copy

    for name in HF_FILES:
        if (checkpoint / name).is_file():
            link_or_copy(checkpoint / name, out_dir / name)
