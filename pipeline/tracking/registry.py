"""The candidate in MLflow's model registry: one version per artifact and recipe, its aliases, and the
policy the registered model is judged under.

A version's source is the artifact uploaded to the tracking server's own artifact store (under
the parent run's `model/`), never a path on the machine that ran kiln: a tracking server refuses
a local path, and another machine could not download it anyway.

Registration is idempotent and crash-safe. A version is found again by its artifact hash and
recipe hash, so re-running an unchanged recipe tags the existing version instead of adding one.
A new version is created with `kiln.registration = incomplete` and no verdict; the verdict, the
checks, the attestation's location and `complete` are set only by `complete()`, the last step of
publishing. `challenger` moves to a version whose latest run passed, and leaves one whose latest run
did not. One lock per registered model (on this machine's cache) keeps two runs from creating the same
version twice.

Tags are what the UI shows, never what a decision rests on: anyone who can write to the tracking server
can set them. Every command that moves `champion` or serves a version (`promote`, `rollback`, `deploy`)
asks `permit`, which verifies the version's signed attestation (kiln.pipeline.provenance.attestation) against its
bytes in the store and against the policy the registered model pins. The pin is itself a signed
statement, set at first registration or by `kiln policy set` (who and why recorded): a run judged under
any other policy cannot register a version of the model. `--force --reason` lets one action go ahead
anyway; it is recorded with that action, and no later command reads it as permission.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core import signing
from kiln.core.errors import BadInput, NotVerified
from kiln.core.files import file_lock, hash_of
from kiln.pipeline.provenance import attestation
from kiln.pipeline.tracking.runs import process_tags, redact_uri

CHALLENGER, CHAMPION = "challenger", "champion"
STATE = "kiln.registration"  # "incomplete" until complete() ran
ARTIFACT_SHA, RECIPE_HASH = "kiln.artifact_sha256", "kiln.recipe_hash"
PREVIOUS = "kiln.previous_champion"
PASSED = "kiln.passed"  # "true" only when the version's run exited 0 (every check passed)
HISTORY = "kiln.champion_history"  # on the registered model: every move of `champion`, newest last
OVERRIDES = "kiln.overrides"  # on a version: every action that went ahead with --force, its reason, who, when
PIN, PIN_SHA = "kiln.policy", "kiln.policy_sha256"  # on the registered model: the signed pin, and its digest (shown)
PIN_HISTORY = "kiln.policy_history"  # on the registered model: every pin, oldest first
PIN_TYPE = "https://kiln.dev/policy-pin/v1"
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


def who() -> str:
    """Who did it, as a record (not an authentication: the signature is that): the CI actor or user@host."""
    if actor := os.environ.get("GITHUB_ACTOR"):
        return f"{actor} (GitHub Actions, {os.environ.get('GITHUB_REPOSITORY', '?')})"
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def register(ctx: Any, artifact: Any, policy_sha256: str) -> Version:
    """The version holding `artifact` for this recipe: found again, or uploaded (once: not again
    when this run's `model/` already holds it, sent there by a Ray node) and created. The registered
    model's policy is pinned to `policy_sha256` at its first registration; a run under another policy
    is refused (BadInput) before anything is registered."""
    client, name = ctx.tracker.client, _name(ctx)
    sha, recipe_hash = artifact.manifest["sha256"], ctx.recipe.digest()
    with _locked(ctx, name):
        ensure_model(client, name)
        pinned = pinned_policy(client, name)
        if pinned is None:
            pin_policy(client, name, policy_sha256, f"first registration, by run {ctx.run_dir.name}")
        elif pinned.policy_sha256 != policy_sha256:
            raise BadInput(policy_mismatch(name, pinned, policy_sha256))
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
    alias: `challenger` comes to a version whose run passed and leaves one whose run did not. Under the
    registry lock: two runs setting one version's tags at once race in MLflow's sqlite store (UNIQUE
    constraint failed: model_version_tags)."""
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
        elif (held := _alias(client, version.name, CHALLENGER)) is not None and str(held.version) == str(version.version):
            client.delete_registered_model_alias(version.name, CHALLENGER)  # its latest verdict is not a pass


def champion_warning(client: Any, name: str, version: str) -> str | None:
    """A line to show wherever the version is shown, when it holds `champion` though its latest run did
    not pass (docs/security.md says what the team should do)."""
    champ = _alias(client, name, CHAMPION)
    if champ is None or str(champ.version) != str(version) or passed(champ):
        return None
    return (f"{name} v{version} still holds `champion`, but its latest run ended "
            f"{champ.tags.get('kiln.verdict', 'without a verdict')}: roll back (`kiln rollback {name}`) or fix it "
            "and judge it again")


def champion_warning_after(client: Any, registered: Version, outcome: Any) -> str | None:
    """`champion_warning` for the run being published, whose verdict is not on the version yet."""
    if int(outcome.exit_code) == 0:
        return None
    champ = _alias(client, registered.name, CHAMPION)
    if champ is None or str(champ.version) != str(registered.version):
        return None
    return (f"v{registered.version} still holds `champion`, but this run ended {outcome.verdict.value}: roll back "
            f"(`kiln rollback {registered.name}`) or fix it and judge it again (docs/security.md)")


def passed(mv: Any) -> bool:
    """Whether a version's latest run passed, as its tags say: for display only (`permit` decides)."""
    if PASSED in mv.tags:
        return mv.tags[PASSED] == "true"
    return mv.tags.get("kiln.verdict") == "Successful"


@dataclass(frozen=True)
class Permit:
    """Why an action on a version may go ahead: its verified attestation passed, or `forced` (a reason)."""

    version: Any  # the MLflow ModelVersion
    verified: signing.Verified | None
    forced: str | None


def verify_version(client: Any, name: str, version: str, local: Path | None = None,
                   pinned_only: bool = True) -> signing.Verified:
    """The version's attestation once it verifies: signed by a trusted key, naming this version, judged under
    the policy the registered model pins (unless not `pinned_only`: a search's champion is the bar as it was
    judged, under whatever policy then), and its subjects equal to the bytes in the store now — or, with
    `local`, to that folder: the engine the verdict names when it names one, else the artifact."""
    mv = _version(client, name, version)
    verified = attestation.download_attestation(client, name, version, mv)
    pinned = pinned_policy(client, name) if pinned_only else None
    judged_under = verified.predicate.get("policy_sha256")
    if pinned is not None and judged_under != pinned.policy_sha256:
        raise NotVerified(f"{name} v{version}: judged under policy {str(judged_under)[:12]}, but {name} pins "
                          f"{pinned.policy_sha256[:12]} (set by {pinned.set_by}: {pinned.reason})")
    if local is not None:
        attestation.check_local(verified, Path(local), f"{name} v{version}")
        return verified
    with tempfile.TemporaryDirectory() as tmp:
        stored = attestation.download_version(client, mv, Path(tmp))
        attestation.check_files(verified, stored, attestation.MODEL, f"{name} v{version}")
    return verified


def permit(client: Any, name: str, version: str, reason: str | None, what: str) -> Permit:
    """May `what` (promote, deploy, …) go ahead on the version? Yes when its attestation verifies and its
    verdict passed; else only with a `reason` (--force), which is for this action alone. Otherwise
    NotVerified (exit 5) when the evidence does not hold, BadInput (exit 2) when it holds and did not pass."""
    mv = _version(client, name, version)
    if mv.tags.get(STATE, "complete") != "complete":
        raise BadInput(f"VERSION: {name} v{version} never finished registering (its run was interrupted); "
                       f"run its recipe again to complete it, then {what}.")
    try:
        verified = verify_version(client, name, version)
    except NotVerified as e:
        if reason:
            return Permit(mv, None, reason)
        raise NotVerified(f"{e}. kiln will not {what} it; pass --force --reason TEXT to override for this "
                          "action (recorded on the version).") from None
    p = verified.predicate
    if p.get("passed") or reason:
        return Permit(mv, verified, None if p.get("passed") else reason)
    raise BadInput(f"VERSION: {name} v{version} did not pass its gate: its run {p.get('run', {}).get('mlflow_run', mv.run_id)} "
                   f"ended {p.get('verdict')} (exit {p.get('exit_code')}), so kiln will not {what} it. "
                   "Fix the candidate and run the recipe again, or pass --force --reason TEXT to override for this "
                   "action; the reason is recorded on the version (and in the champion history when it moves).")


def record_override(client: Any, name: str, version: str, action: str, reason: str) -> None:
    """One more forced action on the version: what, why, who, when (the newest 30)."""
    mv = _version(client, name, version)
    entries = [*json.loads(mv.tags.get(OVERRIDES) or "[]"),
               {"action": action, "reason": reason, "by": who(), "at": round(time.time())}][-30:]
    client.set_model_version_tag(name, version, OVERRIDES, json.dumps(entries))


def _name(ctx: Any) -> str:
    return registered_name(ctx.recipe)


def registered_name(recipe: Any) -> str:
    return recipe.tracking.registered_model or recipe.name


def _locked(ctx: Any, name: str) -> Any:
    """One lock per (store, registered model) on this machine's cache."""
    return file_lock(ctx.cache / "locks" / "registry" / f"{hash_of([redact_uri(ctx.tracker.uri), name])}.lock")


def ensure_model(client: Any, name: str) -> None:
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


@dataclass(frozen=True)
class Pin:
    policy_sha256: str
    set_by: str
    reason: str
    at: int


def pinned_policy(client: Any, name: str) -> Pin | None:
    """The policy the registered model pins, once its signed pin verifies; None when the model does not
    exist or has no pin yet. A pin that does not verify (edited on the server, or signed by a key not
    trusted here) is NotVerified: nothing is judged against a policy nobody trusted kiln to set."""
    from mlflow.exceptions import MlflowException

    try:
        raw = client.get_registered_model(name).tags.get(PIN)
    except MlflowException:
        return None
    if not raw:
        return None
    try:
        envelope = json.loads(raw)
    except ValueError:
        raise NotVerified(f"registered model '{name}': its policy pin is not a signed statement") from None
    p = signing.verify(envelope, PIN_TYPE, f"registered model '{name}': its policy pin").predicate
    if p.get("registered_model") != name:
        raise NotVerified(f"registered model '{name}': its policy pin was made for '{p.get('registered_model')}'")
    return Pin(p["policy_sha256"], p.get("set_by", "?"), p.get("reason", ""), int(p.get("at", 0)))


def pin_policy(client: Any, name: str, policy_sha256: str, reason: str) -> Pin:
    """Pin `policy_sha256` on the registered model: a signed statement of what, who and why, and a line
    in its policy history."""
    pin = Pin(policy_sha256, who(), reason, round(time.time()))
    stmt = signing.statement([signing.Subject(f"registered-model/{name}", policy_sha256)], PIN_TYPE,
                             {"registered_model": name, "policy_sha256": policy_sha256, "set_by": pin.set_by,
                              "reason": reason, "at": pin.at})
    raw = client.get_registered_model(name).tags.get(PIN_HISTORY)
    entries = [*json.loads(raw or "[]"), {"policy_sha256": policy_sha256, "set_by": pin.set_by, "reason": reason,
                                          "at": pin.at}][-30:]
    client.set_registered_model_tag(name, PIN, json.dumps(signing.sign(stmt), separators=(",", ":")))
    client.set_registered_model_tag(name, PIN_SHA, policy_sha256)
    client.set_registered_model_tag(name, PIN_HISTORY, json.dumps(entries))
    return pin


def policy_mismatch(name: str, pinned: Pin, digest: str) -> str:
    when = time.strftime("%Y-%m-%d", time.gmtime(pinned.at)) if pinned.at else "?"
    return (f"tracking.registered_model: '{name}' is judged under policy {pinned.policy_sha256[:12]} (pinned by "
            f"{pinned.set_by} on {when}: {pinned.reason}), and this recipe's policy is {digest[:12]}: a run under "
            f"another policy cannot pass a version of {name}. Judge it under the pinned policy (the gate, evaluate "
            f"and baseline sections; `kiln policy show RECIPE` prints a recipe's digest), register it under another "
            f"name (tracking.registered_model), or change {name}'s policy on purpose: "
            f"`kiln policy set {name} RECIPE --reason TEXT`.")


def promote(client: Any, name: str, version: str, reason: str | None = None) -> str | None:
    """Move `champion` to `version`, remembering the one it replaces; returns that one. Allowed when the
    version's attestation verifies and passed (`permit`), or with `reason` (--force) for this move alone."""
    allowed = permit(client, name, version, reason, "promote")
    previous = _alias(client, name, CHAMPION)
    if previous and previous.version != version:
        client.set_model_version_tag(name, version, PREVIOUS, previous.version)
    if allowed.forced:
        record_override(client, name, version, "promote", allowed.forced)
    client.set_registered_model_alias(name, CHAMPION, version)
    client.set_model_version_tag(name, version, "kiln.deploy", "promoted")
    verdict = allowed.verified.predicate.get("verdict") if allowed.verified else "not verified"
    _record(client, name, {"action": "promote", "version": version, "previous": previous.version if previous else None,
                           "verdict": verdict, **({"forced": allowed.forced} if allowed.forced else {})})
    return previous.version if previous else None


def history(client: Any, name: str) -> list[dict[str, Any]]:
    """Every move of `champion` kiln made, oldest first."""
    raw = client.get_registered_model(name).tags.get(HISTORY)
    return json.loads(raw) if raw else []


def _record(client: Any, name: str, entry: dict[str, Any]) -> None:
    """One more line of the champion history, on the registered model (the newest 30 moves: a tag
    holds at most a few kilobytes)."""
    entries = [*history(client, name), {**entry, "by": who(), "at": round(time.time())}][-30:]
    client.set_registered_model_tag(name, HISTORY, json.dumps(entries))


def rollback(client: Any, name: str, to: str | None = None, reason: str | None = None) -> tuple[str, str]:
    """Move `champion` back to the version it replaced (or to `to`); returns (from, to). The target
    is held to the same rule as a promotion (`permit`)."""
    current = _alias(client, name, CHAMPION)
    if current is None:
        raise BadInput(f"NAME: registered model '{name}' has no champion to roll back; promote a version first.")
    moves = [e for e in history(client, name) if e["action"] == "promote" and e["version"] == current.version]
    target = to or (moves[-1]["previous"] if moves else None) or current.tags.get(PREVIOUS)
    if not target:
        raise BadInput(f"{name} v{current.version} has no recorded previous champion; pass --to VERSION.")
    allowed = permit(client, name, target, reason, "roll back to")
    if allowed.forced:
        record_override(client, name, target, "rollback", allowed.forced)
    client.set_registered_model_alias(name, CHAMPION, target)
    client.set_model_version_tag(name, current.version, "kiln.deploy", "rolled_back")
    _record(client, name, {"action": "rollback", "version": target, "previous": current.version,
                           **({"forced": allowed.forced} if allowed.forced else {})})
    return current.version, target
