"""The candidate in MLflow's model registry: one version per artifact and recipe, and its aliases.

A version's source is the artifact uploaded to the tracking server's own artifact store (under
the parent run's `model/`), never a path on the machine that ran kiln: a tracking server refuses
a local path, and another machine could not download it anyway.

Registration is idempotent and crash-safe. A version is found again by its artifact hash and
recipe hash, so re-running an unchanged recipe tags the existing version instead of adding one.
A new version is created with `kiln.registration = incomplete` and no verdict; the verdict, the
checks and `complete` are set only by `complete()`, the last step of publishing, and the
`challenger` alias moves after that. A run killed in between leaves a version no reader takes
for a finished one; the next run of the recipe completes it. One lock per registered model (on
this machine's cache) keeps two runs from creating the same version twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.pipeline.errors import BadInput
from kiln.pipeline.files import file_lock, hash_of
from kiln.pipeline.tracking import process_tags, redact_uri

CHALLENGER, CHAMPION = "challenger", "champion"
STATE = "kiln.registration"  # "incomplete" until complete() ran
ARTIFACT_SHA, RECIPE_HASH = "kiln.artifact_sha256", "kiln.recipe_hash"
PREVIOUS = "kiln.previous_champion"
SERVING = "kiln.serving"  # {optimize, engine} as judged: a search serves the champion this way


@dataclass(frozen=True)
class Version:
    name: str
    version: str
    reused: bool

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "alias": CHALLENGER, "reused": self.reused}


def register(ctx: Any, artifact: Any) -> Version:
    """The version holding `artifact` for this recipe: found again, or uploaded and created."""
    client, name = ctx.tracker.client, _name(ctx)
    sha, recipe_hash = artifact.manifest["sha256"], ctx.recipe.digest()
    with _locked(ctx, name):
        _ensure_model(client, name)
        found = client.search_model_versions(
            f"name = '{name}' and tags.`{ARTIFACT_SHA}` = '{sha}' and tags.`{RECIPE_HASH}` = '{recipe_hash}'",
            order_by=["version_number DESC"], max_results=1)
        if found:
            return Version(name, found[0].version, reused=True)
        ctx.tracker.log_artifacts(ctx.parent_run, artifact.path, "model")  # uploaded before the version exists
        source = f"{client.get_run(ctx.parent_run).info.artifact_uri.rstrip('/')}/model"
        mv = client.create_model_version(name, source=source, run_id=ctx.parent_run, tags={
            STATE: "incomplete", ARTIFACT_SHA: sha, RECIPE_HASH: recipe_hash, **process_tags()})
        return Version(name, mv.version, reused=False)


def complete(ctx: Any, version: Version, outcome: Any, extra_tags: dict[str, str] | None = None) -> None:
    """The verdict, checks and `extra_tags` of this run on the version, then `complete`, then the
    alias. Under the registry lock: two runs setting one version's tags at once race in MLflow's
    sqlite store (UNIQUE constraint failed: model_version_tags)."""
    client = ctx.tracker.client
    tags = {"kiln.verdict": outcome.verdict.value, "kiln.run_dir": str(ctx.run_dir.resolve()),
            "kiln.last_run": ctx.parent_run, **{f"kiln.check.{r.name}": r.verdict.value for r in outcome.results},
            **(extra_tags or {})}
    with _locked(ctx, version.name):
        for key, value in tags.items():
            client.set_model_version_tag(version.name, version.version, key, value)
        client.set_model_version_tag(version.name, version.version, STATE, "complete")
        client.set_registered_model_alias(version.name, CHALLENGER, version.version)


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


def promote(client: Any, name: str, version: str) -> str | None:
    """Move `champion` to `version`, remembering the one it replaces; returns that one."""
    mv = _version(client, name, version)
    if mv.tags.get(STATE, "complete") != "complete":
        raise BadInput(f"VERSION: {name} v{version} never finished registering (its run was interrupted); "
                       "run its recipe again to complete it, then promote.")
    previous = _alias(client, name, CHAMPION)
    if previous and previous.version != version:
        client.set_model_version_tag(name, version, PREVIOUS, previous.version)
    client.set_registered_model_alias(name, CHAMPION, version)
    client.set_model_version_tag(name, version, "kiln.deploy", "promoted")
    return previous.version if previous else None


def rollback(client: Any, name: str, to: str | None = None) -> tuple[str, str]:
    """Move `champion` back to the version it replaced (or to `to`); returns (from, to)."""
    current = _alias(client, name, CHAMPION)
    if current is None:
        raise BadInput(f"NAME: registered model '{name}' has no champion to roll back; promote a version first.")
    target = to or current.tags.get(PREVIOUS)
    if not target:
        raise BadInput(f"{name} v{current.version} has no recorded previous champion; pass --to VERSION.")
    _version(client, name, target)
    client.set_registered_model_alias(name, CHAMPION, target)
    client.set_model_version_tag(name, current.version, "kiln.deploy", "rolled_back")
    return current.version, target
