"""The candidate in MLflow's model registry: one version per artifact and recipe, and its aliases.

A version's source is the artifact uploaded to the tracking server's own artifact store (under
the parent run's `model/`), never a path on the machine that ran kiln: a tracking server refuses
a local path, and another machine could not download it anyway.

Registration is idempotent and crash-safe. A version is found again by its artifact hash and
recipe hash, so re-running an unchanged recipe tags the existing version instead of adding one.
A new version is created with `kiln.registration = incomplete` and no verdict; the verdict, the
checks and `complete` are set only by `complete()`, the last step of publishing, and the
`challenger` alias moves after that, and only to a version whose run passed (exit 0). `champion`
moves only to a version whose run passed, unless the one who moves it says `--force` and why: the
reason is kept on the version and in the champion history `kiln rollback` reads. A run killed in between leaves a version no reader takes
for a finished one; the next run of the recipe completes it. One lock per registered model (on
this machine's cache) keeps two runs from creating the same version twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.errors import BadInput
from kiln.core.files import file_lock, hash_of
from kiln.pipeline.tracking import process_tags, redact_uri

CHALLENGER, CHAMPION = "challenger", "champion"
STATE = "kiln.registration"  # "incomplete" until complete() ran
ARTIFACT_SHA, RECIPE_HASH = "kiln.artifact_sha256", "kiln.recipe_hash"
PREVIOUS = "kiln.previous_champion"
PASSED = "kiln.passed"  # "true" only when the version's run exited 0 (every check passed)
HISTORY = "kiln.champion_history"  # on the registered model: every move of `champion`, newest last
FORCED = "kiln.forced"  # on a version promoted though its run did not pass: the reason given
SERVING = "kiln.serving"  # {optimize, engine} as judged: a search serves the champion this way
UPLOADED = "kiln.model_uploaded"  # on a run: the sha256 of the artifact its `model/` holds whole


@dataclass(frozen=True)
class Version:
    name: str
    version: str
    reused: bool

    def to_dict(self, passed: bool) -> dict[str, Any]:
        """As the run records it: the alias it gets (`challenger` only when its run passed, else none)."""
        return {"name": self.name, "version": self.version, "alias": CHALLENGER if passed else None,
                "reused": self.reused}


def register(ctx: Any, artifact: Any) -> Version:
    """The version holding `artifact` for this recipe: found again, or uploaded (once: not again
    when this run's `model/` already holds it, sent there by a Ray node) and created."""
    client, name = ctx.tracker.client, _name(ctx)
    sha, recipe_hash = artifact.manifest["sha256"], ctx.recipe.digest()
    with _locked(ctx, name):
        _ensure_model(client, name)
        if found := find(client, name, sha, recipe_hash):
            return Version(name, found.version, reused=True)
        if not uploaded(client, ctx.parent_run, sha):  # uploaded before the version exists
            upload(ctx.tracker, ctx.parent_run, artifact)
        source = f"{client.get_run(ctx.parent_run).info.artifact_uri.rstrip('/')}/model"
        mv = client.create_model_version(name, source=source, run_id=ctx.parent_run, tags={
            STATE: "incomplete", ARTIFACT_SHA: sha, RECIPE_HASH: recipe_hash, **process_tags()})
        return Version(name, mv.version, reused=False)


def find(client: Any, name: str, sha: str, recipe_hash: str) -> Any | None:
    """The newest version of `name` holding the artifact `sha` for the recipe `recipe_hash`, if any:
    a rerun of the recipe registers nothing new and uploads nothing (issue 35: once per version)."""
    found = client.search_model_versions(
        f"name = '{name}' and tags.`{ARTIFACT_SHA}` = '{sha}' and tags.`{RECIPE_HASH}` = '{recipe_hash}'",
        order_by=["version_number DESC"], max_results=1)
    return found[0] if found else None


def upload(tracker: Any, run_id: str, artifact: Any) -> None:
    """`artifact`'s folder to the run's `model/`, then the run's UPLOADED tag: set only once the
    whole folder is there, so `uploaded` never takes half an upload for the artifact."""
    tracker.log_artifacts(run_id, artifact.path, "model")
    tracker.log(run_id, tags={UPLOADED: artifact.manifest["sha256"]})


def uploaded(client: Any, run_id: str, sha: str) -> bool:
    """Whether the run's `model/` holds the artifact `sha`, uploaded whole (`upload`)."""
    return client.get_run(run_id).data.tags.get(UPLOADED) == sha


def complete(ctx: Any, version: Version, outcome: Any, extra_tags: dict[str, str] | None = None) -> None:
    """The verdict, checks and `extra_tags` of this run on the version, then `complete`, then the
    alias. Under the registry lock: two runs setting one version's tags at once race in MLflow's
    sqlite store (UNIQUE constraint failed: model_version_tags)."""
    client = ctx.tracker.client
    passed = int(outcome.exit_code) == 0
    tags = {"kiln.verdict": outcome.verdict.value, PASSED: str(passed).lower(), "kiln.exit_code": str(int(outcome.exit_code)),
            "kiln.run_dir": str(ctx.run_dir.resolve()),
            "kiln.last_run": ctx.parent_run, **{f"kiln.check.{r.name}": r.verdict.value for r in outcome.results},
            **(extra_tags or {})}
    with _locked(ctx, version.name):
        for key, value in tags.items():
            client.set_model_version_tag(version.name, version.version, key, value)
        client.set_model_version_tag(version.name, version.version, STATE, "complete")
        if passed:  # a version whose run did not pass is recorded, never offered as the challenger
            client.set_registered_model_alias(version.name, CHALLENGER, version.version)


def passed(mv: Any) -> bool:
    """Whether a version's run passed: its `kiln.passed` tag (a version tagged before that tag
    existed passed only with a Successful verdict)."""
    if PASSED in mv.tags:
        return mv.tags[PASSED] == "true"
    return mv.tags.get("kiln.verdict") == "Successful"


def check_passed(client: Any, name: str, version: str, reason: str | None, what: str) -> Any:
    """The version, once its run passed; else BadInput naming the run and its verdict, unless a
    reason to go ahead anyway is given (`--force --reason`) or was recorded on it before (`kiln.forced`)."""
    mv = _version(client, name, version)
    reason = reason or mv.tags.get(FORCED)
    if mv.tags.get(STATE, "complete") != "complete":
        raise BadInput(f"VERSION: {name} v{version} never finished registering (its run was interrupted); "
                       f"run its recipe again to complete it, then {what}.")
    if passed(mv) or reason:
        return mv
    verdict = mv.tags.get("kiln.verdict", "no verdict")
    raise BadInput(f"VERSION: {name} v{version} did not pass its gate: its run {mv.tags.get('kiln.last_run', mv.run_id)} "
                   f"ended {verdict} (exit {mv.tags.get('kiln.exit_code', '?')}), so kiln will not {what} it. "
                   f"Fix the candidate and run the recipe again, or pass --force --reason TEXT to override; the reason "
                   "is recorded on the version and in the champion history.")


def _name(ctx: Any) -> str:
    return registered_name(ctx.recipe)


def registered_name(recipe: Any) -> str:
    return recipe.tracking.registered_model or recipe.name


def _locked(ctx: Any, name: str) -> Any:
    """One lock per (store, registered model) on this machine's cache."""
    return file_lock(ctx.cache / "locks" / "registry" / f"{hash_of([redact_uri(ctx.tracker.uri), name])}.lock")


def _ensure_model(client: Any, name: str) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise


def _version(client: Any, name: str, version: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(name, version)
    except MlflowException:
        raise BadInput(f"VERSION: registered model '{name}' has no version {version} "
                       "(see the registry in `kiln ui`, or the registry line of the run's report).") from None


def _alias(client: Any, name: str, alias: str) -> Any | None:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def promote(client: Any, name: str, version: str, reason: str | None = None) -> str | None:
    """Move `champion` to `version`, remembering the one it replaces; returns that one. A version
    whose run did not pass is refused unless `reason` says why it goes anyway (`--force`)."""
    mv = check_passed(client, name, version, reason, "promote")
    forced = not passed(mv)
    reason = reason or mv.tags.get(FORCED)  # `kiln deploy canary --force` records it before the walk
    previous = _alias(client, name, CHAMPION)
    if previous and previous.version != version:
        client.set_model_version_tag(name, version, PREVIOUS, previous.version)
    if forced:
        client.set_model_version_tag(name, version, FORCED, reason)
    client.set_registered_model_alias(name, CHAMPION, version)
    client.set_model_version_tag(name, version, "kiln.deploy", "promoted")
    _record(client, name, {"action": "promote", "version": version, "previous": previous.version if previous else None,
                           "verdict": mv.tags.get("kiln.verdict"), **({"forced": reason} if forced else {})})
    return previous.version if previous else None


def history(client: Any, name: str) -> list[dict[str, Any]]:
    """Every move of `champion` kiln made, oldest first."""
    import json

    raw = client.get_registered_model(name).tags.get(HISTORY)
    return json.loads(raw) if raw else []


def _record(client: Any, name: str, entry: dict[str, Any]) -> None:
    """One more line of the champion history, on the registered model (the newest 30 moves: a tag
    holds at most a few kilobytes)."""
    import json
    import time

    entries = [*history(client, name), {**entry, "at": round(time.time())}][-30:]
    client.set_registered_model_tag(name, HISTORY, json.dumps(entries))


def rollback(client: Any, name: str, to: str | None = None, reason: str | None = None) -> tuple[str, str]:
    """Move `champion` back to the version it replaced (or to `to`); returns (from, to). The target
    is held to the same rule as a promotion: its run passed, or it went in with a recorded reason
    (or `reason` gives one now)."""
    current = _alias(client, name, CHAMPION)
    if current is None:
        raise BadInput(f"NAME: registered model '{name}' has no champion to roll back; promote a version first.")
    moves = [e for e in history(client, name) if e["action"] == "promote" and e["version"] == current.version]
    target = to or (moves[-1]["previous"] if moves else None) or current.tags.get(PREVIOUS)
    if not target:
        raise BadInput(f"{name} v{current.version} has no recorded previous champion; pass --to VERSION.")
    mv = check_passed(client, name, target, reason, "roll back to")
    if reason and not passed(mv):
        client.set_model_version_tag(name, target, FORCED, reason)
    client.set_registered_model_alias(name, CHAMPION, target)
    client.set_model_version_tag(name, current.version, "kiln.deploy", "rolled_back")
    _record(client, name, {"action": "rollback", "version": target, "previous": current.version})
    return current.version, target
