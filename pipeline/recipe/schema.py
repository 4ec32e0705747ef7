"""The recipe: one YAML file, one validated object, everything a run does.

Validation is pure (no network, no files written, no models loaded). Plugin sections are tagged
unions built from the registries, so a typo is an error and an unknown plugin name gets a
"did you mean". `--set a.b=value` overrides are applied to the raw YAML before validation, so the
CLI wins and the result is validated exactly like the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

import kiln.engine  # noqa: F401 - registers the engine backends
import kiln.evaluate.quality  # noqa: F401 - registers the quality evals
import kiln.optimize  # noqa: F401 - registers the quantization methods
from kiln.deploy.config import DeployConfig
from kiln.engine.base import BACKENDS
from kiln.engine.llama_cpp.config import drafting_candidate
from kiln.evaluate.perf.config import PerformanceConfig
from kiln.evaluate.quality.base import QUALITY_EVALS
from kiln.evaluate.tune import TuneConfig, check_space
from kiln.optimize.base import QUANTIZERS
from kiln.pipeline.recipe.grid import expand_grids
from kiln.pipeline.recipe.kv_cache_rule import unjudged_kv_cache
from kiln.core import yaml_input
from kiln.core.errors import BadInput
from kiln.core.files import hash_of
from kiln.core.gate.base import CheckConfig
from kiln.core.gate.lossless import unguarded
from kiln.core.gate.policy import GateSection
from kiln.core.metrics import METRICS
from kiln.core.units import DEFAULT_CURRENCY, currency_problem


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(Section):
    path: str = Field("demo", description="'demo' (SmolLM2-135M-Instruct, offline) or a local HF checkpoint folder")

    @model_validator(mode="before")
    @classmethod
    def _removed_fields(cls, data: Any) -> Any:
        """Both were accepted and never read; say where the setting lives instead of ignoring it."""
        if isinstance(data, dict):
            if "dtype" in data:
                raise ValueError("model.dtype is not a recipe field (it was never read): the serving "
                                 "precision is engine.dtype (torch backend)")
            if "trust_remote_code" in data:
                raise ValueError("model.trust_remote_code is not a recipe field (it was never read): kiln's "
                                 "quantizers never run a checkpoint's own code; the torch engine's "
                                 "engine.trust_remote_code is the one switch, off by default")
        return data


def _quality_fields() -> dict[str, Any]:
    """`evaluate.quality`'s fields: one per registered eval, its config (or None where its section's
    default is None: off unless set) with the default and description it declares."""
    fields = {}
    for name in QUALITY_EVALS.names():
        config, section = QUALITY_EVALS.config(name), QUALITY_EVALS.get(name).section
        fields[name] = (config if section.default is not None else config | None, section)
    return fields


QualitySection = create_model("QualitySection", __base__=Section, **_quality_fields())


class BenchmarkSection(Section):
    prompts: str = Field("demo", description="'demo' (GSM8K questions), 'demo-copy' (rewrite an Austen passage, "
                         "fixing its typos: copy-heavy) or a local JSONL with a 'prompt' field")
    num_prompts: int = Field(8, ge=1)
    max_new_tokens: int = Field(32, ge=2)
    batch_sizes: list[int] = Field(default_factory=lambda: [1])
    repeats: int = Field(3, ge=1, description="rounds; each runs every prompt on both arms back to back, "
                                              "one paired sample per prompt (repeats x num_prompts pairs)")


class EvaluateSection(Section):
    quality: QualitySection = QualitySection()
    benchmark: BenchmarkSection = BenchmarkSection()
    load: PerformanceConfig | None = Field(
        None, description="serve each arm over HTTP and run this load shape (a sweep gives the report's curves)")


class TrackingSection(Section):
    uri: str | None = Field(None, description="MLflow tracking URI; default $MLFLOW_TRACKING_URI, else "
                                             "sqlite:///<kiln's home>/mlflow.db ($KILN_HOME, else ~/.local/share/kiln), "
                                             "whatever the current folder; a sqlite store keeps its artifacts in "
                                             "mlruns/ beside it")
    experiment: str = "kiln"
    registered_model: str | None = Field(None, description="registry name; default the recipe name")


# The plugin unions: each registry knows its plugins once their packages are imported.
OptimizeConfig = QUANTIZERS.config_union()
EngineSectionConfig = BACKENDS.config_union()


class BaselineSection(Section):
    """The arm the candidate is judged against: the checkpoint unchanged (optimize 'none')."""

    engine: EngineSectionConfig | None = Field(  # type: ignore[valid-type]
        None, description="how the baseline is served; unset: on the candidate's engine, so the gate isolates the "
                          "quantization. Set it (e.g. {backend: torch}) to judge the whole tuned configuration "
                          "against what a naive deployment serves")


class CandidateSection(Section):
    """One candidate serving configuration: its quantization and its engine, or the registry's champion."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="names the candidate in the report and MLflow")
    champion: bool = Field(False, description="the registered model's current champion, as it was judged: its "
                                              "recorded optimize and engine, its artifact from the registry (so a "
                                              "change is judged against production); left out while there is none")
    optimize: OptimizeConfig | None = Field(  # type: ignore[valid-type]
        None, description="the candidate's quantization (none: the engine compresses it itself)")
    engine: EngineSectionConfig | None = Field(None, description="default: torch")  # type: ignore[valid-type]
    # Read from the raw recipe and expanded before validation (candidate_grid.py): never set on a loaded one.
    grid: dict[str, list[Any]] | None = Field(
        None, exclude_if=lambda v: v is None,
        description="options to try in every combination, as dotted paths to lists of values (e.g. "
                    "{engine.speculative: [null, {type: ngram-simple}], engine.cache_type_k: [f16, q8_0]}): the "
                    "recipe loads one candidate per combination, named <name>.<option>-<value>... (spec-ngram-simple, "
                    "k-q8_0), each judged as any candidate (docs/engines.md, Levers)")

    @model_validator(mode="after")
    def _configured_or_champion(self) -> CandidateSection:
        if self.grid is not None:
            raise ValueError("grid: expanded when the recipe loads (candidate_grid.expand_grids); a candidate "
                             "validated on its own lists one configuration")
        if self.champion:
            if self.optimize is not None or self.engine is not None:
                raise ValueError("a champion candidate is served as the registry recorded it: leave out its "
                                 "optimize and engine")
            return self
        if self.optimize is None:
            raise ValueError("optimize: required (the candidate's quantization), or champion: true")
        if self.engine is None:
            self.engine = BACKENDS.config("torch")()
        return self



class RaySection(Section):
    """The cluster a search fans its candidates out on (`search.executor: ray`)."""

    address: str = Field("auto", min_length=1,
                         description="what ray.init connects to: auto (the cluster this machine belongs to, or "
                                     "$RAY_ADDRESS), host:port of a head's GCS, or ray://head:10001 (Ray Client)")
    hardware: str | None = Field(
        None, pattern=r"^[0-9a-f]{12,64}$",
        description="the hardware fingerprint (its hash, as `kiln run` prints each node's) that timed stages must run "
                    "on; default: the node the first candidate's build ran on")


class SearchSection(Section):
    """How `kiln run` picks among `candidates`: the best objective among those every check passes."""

    objective: Literal["decode_tok_s", "ttft_ms", "load_goodput"] = Field(
        "decode_tok_s", description="what the winner is best at, as a paired ratio to the baseline: decode_tok_s "
                                    "(higher is better) or ttft_ms (lower is better) from the decode benchmark, or "
                                    "load_goodput (requests per second within the SLO) from evaluate.load")
    budget_s: float | None = Field(None, gt=0, description="stop starting candidate stages after this many seconds; "
                                                           "a candidate not finished by then cannot win")
    price_per_hour: float | None = Field(
        None, gt=0, description="what the machine costs per hour, in the recipe's `currency`: the candidates table "
                                "then shows each one's cost per 1M output tokens at batch 1, from its decode benchmark")
    # Where the candidates run, not what is judged: left at their defaults they stay out of the resolved
    # recipe, so every recipe written before them keeps its digest.
    executor: Literal["local", "ray"] = Field(
        "local", exclude_if=lambda v: v == "local",
        description="where each candidate's stages of a phase run: local (this process, one after another) or ray "
                    "(Ray tasks on the cluster at search.ray.address; docs/search.md)")
    ray: RaySection = Field(default_factory=lambda: RaySection(), exclude_if=lambda v: v == RaySection(),
                            description="the Ray cluster of search.executor ray")


class Recipe(Section):
    """A kiln recipe. See recipes/ for examples and `kiln schema` for every field."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="names the run and the registered model")
    description: str = ""
    runner: Literal["cpu", "gpu"] | None = Field(
        None, description="where CI runs this recipe; default: gpu for GPU-only engines, else cpu")
    model: ModelSection = ModelSection()
    optimize: OptimizeConfig | None = Field(  # type: ignore[valid-type]
        None, description="the one candidate's quantization (or list several under `candidates`); the baseline is "
                          "always 'none'")
    engine: EngineSectionConfig = Field(default_factory=lambda: BACKENDS.config("torch")())  # type: ignore[valid-type]
    tune: TuneConfig | None = Field(None, description="search the engine's knobs for the most goodput under an SLO "
                                                      "(evaluate/tune.py); `engine.tune` is read as this too")
    candidates: list[CandidateSection] | None = Field(
        None, min_length=1, description="several candidate serving configurations, each judged against the baseline "
                                        "by the gate; the search keeps the best (`search.objective`) that passes")
    search: SearchSection = SearchSection()
    # Shown, never computed with: left at the default it stays out of the resolved recipe (digests unchanged).
    currency: str = Field(DEFAULT_CURRENCY, exclude_if=lambda v: v == DEFAULT_CURRENCY,
                          description="the currency of search.price_per_hour and evaluate.load.price_per_hour, in "
                                      "which the report, the pull-request comment and the load summary show every "
                                      "cost: an ISO 4217 code (USD shows as $, EUR as €, GBP as £; others follow "
                                      "the figure, 12.50 CHF) or a symbol")
    baseline: BaselineSection = BaselineSection()
    evaluate: EvaluateSection = EvaluateSection()
    gate: GateSection
    tracking: TrackingSection = TrackingSection()
    deploy: DeployConfig = DeployConfig()

    @field_validator("currency")
    @classmethod
    def _currency(cls, v: str) -> str:
        if why := currency_problem(v):
            raise ValueError(why)
        return v

    @model_validator(mode="before")
    @classmethod
    def _one_form(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = expand_grids(_tune_beside_engine(data))
        if isinstance(data, dict) and data.get("candidates") is not None:
            # A resolved recipe (run_dir/recipe.yaml) holds optimize: null and the default engine: it reloads.
            default_engine = BACKENDS.config("torch")().model_dump(mode="json")
            both = [k for k, unset in (("optimize", None), ("engine", default_engine)) if data.get(k, unset) != unset]
            if both:
                raise ValueError(f"{' and '.join(both)}: a recipe with `candidates` sets each candidate's optimize "
                                 "and engine inside its entry; move them there")
        elif isinstance(data, dict) and data.get("optimize") is None:
            raise ValueError("optimize: required (the candidate's quantization, e.g. {method: int8_weight_only}), "
                             "or list several serving configurations under `candidates`")
        return data

    @model_validator(mode="after")
    def _engine_takes_the_artifact(self) -> Recipe:
        if self.candidates is None:
            _check_arm(self.optimize, self.engine, "")
            if (draft := drafting_candidate(self.engine)) and draft.optimize is None:
                raise ValueError(f"engine.speculative.draft_model: {{candidate: {draft.candidate}}} names another "
                                 "candidate, and this recipe lists none: give the path of a .gguf file, or list "
                                 "both configurations under candidates")
        else:
            names = [c.name for c in self.candidates]
            if dup := sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(f"candidates: names must differ; {', '.join(dup)} appears more than once")
            for i, c in enumerate(self.candidates):
                if not c.champion:
                    _check_arm(c.optimize, c.engine, f"candidates.{i}.")
                if why := _draft_problem(self.candidates, i):
                    raise ValueError(f"candidates.{i}.engine.speculative.draft_model: {why}")
            if sum(c.champion for c in self.candidates) > 1:
                raise ValueError("candidates: the registry has one champion; list it once")
            if self.tune is not None:
                raise ValueError("tune: knob tuning runs on a single-candidate recipe (optimize + engine); in a "
                                 "search, list each knob setting as its own candidate")
        if self.tune is not None:
            check_space(self.engine, self.tune)
        if self.search.objective == "load_goodput":
            if self.evaluate.load is None:
                raise ValueError("search.objective load_goodput: ranks candidates by the load stage's goodput; set "
                                 "evaluate.load (a load shape with an slo), or pick decode_tok_s")
            if self.evaluate.load.repeats < 2:
                raise ValueError(f"search.objective load_goodput: the ratio's interval needs at least 2 interleaved "
                                 f"repeats; evaluate.load.repeats is {self.evaluate.load.repeats}")
        if (base := self.baseline.engine) is not None:
            backend = BACKENDS.get(base.backend)
            if not backend.scores:
                raise ValueError(f"baseline.engine.backend '{base.backend}' cannot score prompts, and the quality "
                                 "checks compare the candidate's scores with the baseline's: serve the baseline on "
                                 "another backend (torch is the reference)")
            if QUANTIZERS.get("none").artifact_format not in backend.artifact_formats:
                raise ValueError(f"baseline.engine.backend '{base.backend}' cannot load the unquantized checkpoint")
        if why := unguarded_speculation(self):  # speculative decoding is judged lossless, or not run
            raise ValueError(why)
        if why := unjudged_kv_cache(self):  # a quantized KV cache is judged at the longest context it serves
            raise ValueError(why)
        if problems := unmeasured_checks(self):
            raise ValueError("every gate check needs a stage of the recipe that measures it (unmeasured, it could "
                             "only end Inconclusive):" + "".join(f"\n    {p}" for p in problems))
        return self

    def engine_for(self, role: str) -> Any:
        """The serving config of an arm: the candidate's engine, or baseline.engine when set."""
        return self.baseline.engine if role == "baseline" and self.baseline.engine is not None else self.engine

    def arms(self) -> list[tuple[str, Recipe]]:
        """(name, single-candidate recipe) per candidate. A search recipe's baseline defaults to the
        checkpoint on the reference torch backend: what a naive deployment serves."""
        if self.candidates is None:
            return [("candidate", self)]
        base = self.baseline.engine or BACKENDS.config("torch")()
        return [(c.name, self.model_copy(update={"optimize": c.optimize, "engine": _drafted(c.engine, self.candidates),
                                                 "candidates": None, "baseline": BaselineSection(engine=base)}))
                for c in self.candidates if not c.champion]

    def with_champion(self, serving: dict[str, Any] | None) -> Recipe:
        """The recipe with its champion candidate served as `serving` ({optimize, engine}, as the
        registry recorded it) in its place, or left out when there is no champion yet."""
        if self.candidates is None or not any(c.champion for c in self.candidates):
            return self
        listed = []
        for c in self.candidates:
            if not c.champion:
                listed.append(c)
            elif serving is not None:
                listed.append(CandidateSection.model_validate({"name": c.name, **serving}))
        if not listed:
            raise BadInput("candidates: the only candidate is the champion and the registry has none yet; "
                           "list a serving configuration to judge, or promote a version first (kiln promote)")
        return self.model_copy(update={"candidates": listed})

    def single(self, command: str) -> Recipe:
        """The recipe itself when it has one candidate; a search recipe is refused by `command`."""
        if self.candidates is not None:
            raise BadInput(f"{command} takes a recipe with one candidate (optimize + engine); this one lists "
                           f"{len(self.candidates)} under `candidates`")
        return self

    def digest(self) -> str:
        """Content hash of the resolved recipe: keys runs and tags MLflow runs."""
        return hash_of(self.model_dump(mode="json"))


def _draft_problem(candidates: list[CandidateSection], i: int) -> str | None:
    """Why candidate `i`'s draft, given as another candidate (`draft_model: {candidate: NAME}`), cannot
    draft for it; None when it can or drafts otherwise. One recipe's candidates quantize one checkpoint,
    so the draft has the model's vocabulary."""
    draft = drafting_candidate(candidates[i].engine)
    if draft is None or draft.optimize is not None:  # a resolved arm (a champion as recorded) says how it is made
        return None
    named = {c.name: c for c in candidates}.get(draft.candidate)
    fix = "name another candidate of this recipe whose optimize.method is gguf (e.g. a q4_0 of the checkpoint)"
    if draft.candidate == candidates[i].name:
        return f"candidate '{draft.candidate}' names itself; {fix}, or use an n-gram type (ngram-simple)"
    if named is None:
        from kiln.core.registry import did_you_mean

        others = [c.name for c in candidates if c.name != candidates[i].name]
        return f"no candidate is named '{draft.candidate}'.{did_you_mean(draft.candidate, others)} {fix.capitalize()}"
    if named.champion:
        return f"'{draft.candidate}' is the registry's champion, whose artifact this run does not make; {fix}"
    if (fmt := QUANTIZERS.get(named.optimize.method).artifact_format) != "gguf":
        return (f"'{draft.candidate}' (optimize.method {named.optimize.method}) makes a {fmt} artifact, and "
                f"llama-server drafts with a GGUF; {fix}, or give the path of a .gguf file")
    return None


def _drafted(engine: Any, candidates: list[CandidateSection]) -> Any:
    """`engine` with a draft given as another candidate told how that candidate's artifact is made (its
    optimize): the arm is a recipe of its own, and its optimize stage makes the draft under that key."""
    draft = drafting_candidate(engine)
    if draft is None or draft.optimize is not None:
        return engine
    return engine.draft_made_by(next(c for c in candidates if c.name == draft.candidate).optimize)


def _tune_beside_engine(data: dict[str, Any]) -> dict[str, Any]:
    """`engine.tune` (where recipes wrote it before tuning moved out of engine/) read as the
    recipe's `tune`; a baseline's or a search candidate's is refused with the reason."""
    baseline = data.get("baseline")
    if isinstance(baseline, dict) and isinstance(baseline.get("engine"), dict) and "tune" in baseline["engine"]:
        raise ValueError("baseline.engine.tune: the baseline is served as it is today, untuned; tune the "
                         "candidate's engine (tune) instead")
    for i, c in enumerate(data.get("candidates") or []):
        if isinstance(c, dict) and isinstance(c.get("engine"), dict) and "tune" in c["engine"]:
            raise ValueError(f"candidates.{i}.engine.tune: knob tuning runs on a single-candidate recipe "
                             "(optimize + engine); in a search, list each knob setting as its own candidate")
    engine = data.get("engine")
    if isinstance(engine, dict) and "tune" in engine:
        if "tune" in data:
            raise ValueError("engine.tune and tune: set the search space once, as tune (beside engine)")
        engine = dict(engine)
        data = {**data, "engine": engine, "tune": engine.pop("tune")}
    return data


def unguarded_speculation(recipe: Recipe) -> str | None:
    """Why `recipe`'s gate cannot judge its candidates: one claims lossless output (speculative
    decoding) and gate.checks has no lossless check (kiln.core.gate.lossless); None when it can."""
    arms = [("engine", recipe.engine)] if recipe.candidates is None else \
        [(f"candidates.{i}.engine", c.engine) for i, c in enumerate(recipe.candidates)]
    return unguarded(arms, recipe.gate.checks)


def unmeasured_checks(recipe: Recipe) -> list[str]:
    """One line per gate check that no stage of `recipe` measures: the check by index and label,
    and the section to add. What measures a metric is declared with it (`Metric.measured_by`)."""
    tasks, unread = _lmeval_tasks(recipe)
    problems = []
    for i, check in enumerate(recipe.gate.checks):
        if why := _unmeasured(recipe, check, tasks, unread):
            problems.append(f"gate.checks.{i} ({check.label}): {why}")
    return problems


def _unmeasured(recipe: Recipe, check: CheckConfig, tasks: set[str], unread: bool) -> str | None:
    """Why no stage of `recipe` measures `check`'s metric as the check reads it; None when one does."""
    from kiln.core.registry import did_you_mean
    from kiln.evaluate.tasks import SHIPPED

    m = METRICS.get(check.metric)
    if m is None:
        if unread or any(check.metric.startswith(f"{t}_") for t in tasks - set(SHIPPED)):
            return None  # a metric of the user's own lm-eval task, declared when the task runs
        gated = [n for n, g in METRICS.items() if g.measured_by and g.kind == type(check).reads]
        return (f"unknown metric '{check.metric}'.{did_you_mean(check.metric, gated)} An lm-eval task's metrics are "
                "named <task>_<metric> after a task listed in evaluate.quality.lmeval.tasks")
    if m.measured_by is None:
        return f"'{m.name}' is recorded beside the measurements ({m.description}); no check gates on it"
    if m.kind != type(check).reads:
        return (f"a {check.kind} check reads {type(check).reads} metrics, and '{m.name}' is a {m.kind} metric: "
                "gate it with a check of its own kind")
    if not _section_set(recipe, m.measured_by):
        fix = f"set {m.measured_by}: true" if _section(recipe, m.measured_by) is False else f"add {m.measured_by}"
        return f"no stage of this recipe measures {m.name}: {fix}" + (f" with {m.task} in its tasks" if m.task else "")
    if m.task and m.task not in tasks and (m.task in SHIPPED or not unread):
        return f"no stage of this recipe measures {m.name}: add {m.task} to evaluate.quality.lmeval.tasks"
    return None


def _section(recipe: Recipe, path: str) -> Any:
    node: Any = recipe
    for part in path.split("."):
        node = getattr(node, part, None)
    return node


def _section_set(recipe: Recipe, path: str) -> bool:
    if path == "optimize" and recipe.candidates:  # a search builds each candidate from its own entry
        return True
    return _section(recipe, path) not in (None, False)


def _lmeval_tasks(recipe: Recipe) -> tuple[set[str], bool]:
    """The names of the lm-eval tasks the recipe runs, and whether a task YAML could not be read
    here (then the run reports it, and a check on its metrics is left to the run)."""
    from kiln.evaluate.tasks import SHIPPED, prepare_tasks

    lmeval = recipe.evaluate.quality.lmeval
    names, unread = {t for t in (lmeval.tasks if lmeval else []) if t in SHIPPED}, False
    for spec in lmeval.tasks if lmeval else []:
        if spec not in SHIPPED:
            try:  # a user's YAML alone: its `task:` name is read, nothing is rendered or written
                names.update(prepare_tasks([spec], Path(".")).names)
            except BadInput:
                unread = True
    return names, unread


def _check_arm(optimize: Any, engine: Any, where: str) -> None:
    """One candidate's quantization and engine fit each other; `where` prefixes the field paths."""
    backend = BACKENDS.get(engine.backend)
    if optimize.method != "none" and not backend.takes_quantized:
        raise ValueError(
            f"{where}engine.backend '{engine.backend}' converts the unquantized checkpoint and compresses it "
            f"itself (its own precision option), so it cannot take {where}optimize.method '{optimize.method}''s "
            "quantized artifact: set optimize.method: none, or serve it on the torch backend")
    fmt = QUANTIZERS.get(optimize.method).artifact_format
    quantized = backend.quantized_formats
    if optimize.method != "none" and quantized is not None and fmt in backend.artifact_formats and fmt not in quantized:
        raise ValueError(f"{where}optimize.method '{optimize.method}' writes a quantized {fmt} artifact, and "
                         f"{where}engine.backend '{engine.backend}' takes quantized weights only as "
                         f"{', '.join(quantized)}: quantize with a method that writes {quantized[0]}, or use none")
    if fmt not in backend.artifact_formats:
        raise ValueError(f"{where}optimize.method '{optimize.method}' writes a {fmt} artifact, which "
                         f"{where}engine.backend '{engine.backend}' cannot load: serve it on an engine that reads "
                         f"{fmt} (llama_cpp for gguf)")
    if not backend.scores:  # perplexity always runs; agreement and lm-eval need scoring too
        raise ValueError(
            f"{where}engine.backend '{engine.backend}' cannot score prompts (no log-likelihoods or next-token "
            "distributions), and the quality checks (perplexity, agreement, lm-eval) need them: run the recipe "
            "on another backend (docs/engines.md)")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML: numbers, bools, lists work).

    Numeric path parts index lists: `gate.checks.0.margin=0.1`.
    """
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or "" in key.split("."):
            raise BadInput(f"--set {item!r}: expected KEY=VALUE, for example --set optimize.bits=8")
        parsed = yaml_input.parse(value, f"--set {key}") if value else None
        node: Any = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            node = _child(node, part, ".".join(parts[: i + 1]))
        last = parts[-1]
        if isinstance(node, list):
            node[_index(node, last, key)] = parsed
        elif isinstance(node, dict):
            node[last] = parsed
        else:
            raise BadInput(f"--set {key}: {'.'.join(parts[:-1])} is a {type(node).__name__}, not a section with fields")
    return raw


def _index(node: list, part: str, path: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise BadInput(f"--set {path}: '{part}' is not an index of a list of {len(node)} items")
    return int(part)


def _child(node: Any, part: str, path: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, path)]
    if not isinstance(node, dict):
        raise BadInput(f"--set {path}: cannot set a field inside a {type(node).__name__}")
    return node.setdefault(part, {})


def format_errors(err: ValidationError, raw: dict[str, Any]) -> list[str]:
    """One line per problem, with the full field path as the user wrote it."""
    lines = []
    for e in err.errors():
        path = _user_path(e["loc"], raw)
        if e["type"] == "union_tag_invalid":
            ctx = e["ctx"]
            from kiln.core.registry import did_you_mean

            choices = [t.strip(" '") for t in str(ctx["expected_tags"]).split(",")]
            lines.append(f"{path}.{ctx['discriminator'].strip(chr(39))}: unknown name '{ctx['tag']}'."
                         f"{did_you_mean(str(ctx['tag']), choices)}")
            continue
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; `kiln schema` lists every field)"
        lines.append(f"{path}: {msg}" if path else msg)
    return lines


def _user_path(loc: tuple, raw: Any) -> str:
    """Drop the union tags pydantic inserts into locations (('optimize', 'gptq', 'bits'))."""
    parts, node = [], raw
    for item in loc:
        if isinstance(node, dict) and isinstance(item, str) and item not in node and parts and any(
            v == item for v in node.values() if isinstance(v, str)
        ):
            continue  # a discriminator value, not a key the user wrote
        parts.append(str(item))
        if isinstance(node, dict):
            node = node.get(item)
        elif isinstance(node, list) and isinstance(item, int) and item < len(node):
            node = node[item]
        else:
            node = None
    return ".".join(parts)


def load_recipe(path: Path | str, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file; raise BadInput listing every problem."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"Recipe file not found: {path}. Pass the path to a YAML recipe (see recipes/).")
    raw = yaml_input.parse(yaml_input.read_text(path), str(path)) or {}
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: a recipe is a YAML mapping (name:, optimize:, ...), not a {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        problems = format_errors(e, raw)
        raise BadInput(f"{path}: {len(problems)} problem(s) in the recipe:", problems) from None
