"""`kiln verify` (a run's or a registered version's signed verdict against the bytes it judged) and
`kiln key` (the keys kiln signs with and trusts). Registered on the one `kiln` app (cli_app.py) when
`cli.py` imports it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.core.errors import BadInput
from kiln.pipeline.cli.app import RunsOpt, app, console, err, typer_app
from kiln.pipeline.cli.ops import TrackingOpt, run_dir

key_app = typer_app(help="The key kiln signs verdicts with, and the keys it trusts.")
app.add_typer(key_app, name="key")


@app.command()
def verify(target: Annotated[str, typer.Argument(metavar="RUN|NAME", help="a run (folder or name), or a registered model")],
           version: Annotated[str | None, typer.Argument(metavar="VERSION", help="with NAME: the version")] = None,
           runs: RunsOpt = None, tracking_uri: TrackingOpt = None,
           engine: Annotated[Path | None, typer.Option(help="with NAME VERSION: check this local engine (or artifact) "
                                                             "folder against the judged bytes instead of downloading "
                                                             "the version's artifact (what a pod runs before serving)")]
           = None) -> None:
    """Check a signed verdict against what it judged; exit with the verdict's code (0 passed, 1 failed, 3 inconclusive).

    RUN: the run's attestation, the candidate's artifact and engine on disk, every stage it rests on.
    NAME VERSION: the version's latest attestation, its bytes in the tracking server's store, and the
    policy the registered model pins. Anything that does not match: exit 5, naming it.
    """
    if version is None:
        from kiln.pipeline.provenance.attestation import verify_run

        if engine is not None:
            raise BadInput("--engine: only with NAME VERSION (a run's engine is checked from the run itself).")

        try:
            folder = run_dir(target, runs)
        except BadInput as e:
            raise BadInput(f"{e} For a registered model, name the version too: kiln verify {target} VERSION.") from None
        verified = verify_run(folder)
        where = f"run {target}"
        warning = None
    else:
        from kiln.pipeline.tracking import registry as model_registry
        from kiln.pipeline.tracking.runs import open_client

        client = open_client(tracking_uri)
        verified = model_registry.verify_version(client, target, version, local=engine)
        where, warning = f"{target} v{version}", model_registry.champion_warning(client, target, version)
    _print(where, verified)
    if warning:
        console.print(f"[yellow]⚠️ {warning}[/yellow]", soft_wrap=True)
    raise typer.Exit(int(verified.predicate.get("exit_code", 4)))


def _print(where: str, verified: Any) -> None:
    p = verified.predicate
    subjects = verified.subjects()
    console.print(f"✓ {where}: the signature (key {verified.key_id[:12]}) and {len(subjects)} judged files verify; "
                  f"{len(p.get('evidence', []))} stages of evidence", soft_wrap=True, markup=False)
    console.print(f"  verdict: {p.get('verdict')} (exit {p.get('exit_code')}), {p.get('summary', '')}", soft_wrap=True,
                  markup=False)
    console.print(f"  policy {str(p.get('policy_sha256'))[:12]}; judged by kiln {p.get('kiln_version')} on "
                  f"{p.get('machine', {}).get('host', '?')} at {p.get('created_at')}", soft_wrap=True, markup=False)


@key_app.command("show")
def key_show() -> None:
    """Print the public key kiln signs with here (add it to a team's $KILN_TRUSTED_KEYS) and every key it trusts."""
    from kiln.core import signing

    key = signing.signing_key().public_key()
    print(signing.public_pem(key), end="")  # stdout holds the PEM alone: `kiln key show > team.pub`
    source = os.environ.get(signing.SIGNING_KEY_ENV) or str(signing.machine_key_path())
    err.print(f"signing key {signing.key_id(key)[:12]} ({source})", soft_wrap=True, markup=False)
    for kid in signing.trusted_keys():
        err.print(f"trusted: {kid[:12]}", markup=False)


@key_app.command("new")
def key_new(path: Annotated[Path, typer.Argument(help="where to write the private key (PEM, mode 0600)")]) -> None:
    """Make a new Ed25519 signing key (for a team's CI: store it as a secret, point $KILN_SIGNING_KEY at it)."""
    from kiln.core import signing

    if path.exists():
        raise BadInput(f"PATH: {path} exists; kiln never overwrites a key. Choose another path.")
    key = signing.new_key(path).public_key()
    pub = path.with_name(path.name + ".pub")
    pub.write_text(signing.public_pem(key))
    console.print(f"key {signing.key_id(key)[:12]}: private {path}, public {pub}", soft_wrap=True, markup=False)
