"""Signed statements: what kiln measured, bound to the bytes it measured, under a key someone trusts.

kiln signs two kinds of statement (`kiln.pipeline.provenance` builds them): a stage's evidence (the
digests of what it read and wrote) and a run's verdict (the artifact's file digests, the policy and
every piece of evidence the verdict rests on). Both are in-toto Statements (v1) in a DSSE envelope,
the format of in-toto attestations and SLSA provenance, signed with Ed25519 through `cryptography`.

Keys:
- the signing key is the PEM (PKCS#8) private key at $KILN_SIGNING_KEY, else this machine's own key
  under kiln's cache (`keys/kiln-signing.pem`, made on first use, mode 0600);
- a statement is trusted when a signature verifies under a trusted public key: the signing key's own,
  and every PEM public key in $KILN_TRUSTED_KEYS (paths separated by os.pathsep) or in the cache's
  `keys/trusted/` folder. The recipe names none: a recipe is what a pull request edits.

A key id is the sha256 of the raw public key, so a statement names the key that signed it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.core.errors import BadInput, NotVerified

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
SIGNING_KEY_ENV = "KILN_SIGNING_KEY"
TRUSTED_KEYS_ENV = "KILN_TRUSTED_KEYS"


def _cache() -> Path:
    from kiln.core.home import kiln_cache

    return kiln_cache()


def pae(payload_type: str, body: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what is signed, so the type cannot be swapped."""
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(body), body)


def key_id(public: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def _load_private(path: Path) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise BadInput(f"${SIGNING_KEY_ENV}: cannot read an unencrypted PEM private key from {path} ({e}). "
                       "Make one with `kiln key new PATH`, or unset it to use this machine's own key.") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BadInput(f"${SIGNING_KEY_ENV}: {path} is not an Ed25519 key; kiln signs with Ed25519 "
                       "(`kiln key new PATH` makes one).")
    return key


def new_key(path: Path) -> Any:
    """A new Ed25519 private key written to `path` (PEM, mode 0600, never over an existing file)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # fails if another process made it first: theirs is kept
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return _load_private(path)


def machine_key_path() -> Path:
    return _cache() / "keys" / "kiln-signing.pem"


def signing_key() -> Any:
    """The key kiln signs with: $KILN_SIGNING_KEY, else this machine's own (made on first use)."""
    if given := os.environ.get(SIGNING_KEY_ENV):
        return _load_private(Path(given))
    path = machine_key_path()
    return _load_private(path) if path.exists() else new_key(path)


def public_pem(public: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def _load_public(path: Path) -> Any:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except (OSError, ValueError) as e:
        raise BadInput(f"${TRUSTED_KEYS_ENV}: cannot read a PEM public key from {path} ({e}); "
                       "`kiln key show` prints one.") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BadInput(f"${TRUSTED_KEYS_ENV}: {path} is not an Ed25519 public key.")
    return key


def trusted_keys() -> dict[str, Any]:
    """key id -> public key, for every key whose signature kiln accepts here."""
    keys = [signing_key().public_key()]
    paths = [p for p in os.environ.get(TRUSTED_KEYS_ENV, "").split(os.pathsep) if p.strip()]
    folder = _cache() / "keys" / "trusted"
    paths += sorted(str(p) for p in folder.glob("*.pem")) if folder.is_dir() else []
    keys += [_load_public(Path(p)) for p in paths]
    return {key_id(k): k for k in keys}


@dataclass(frozen=True)
class Subject:
    name: str
    sha256: str


def statement(subjects: list[Subject], predicate_type: str, predicate: dict[str, Any]) -> dict[str, Any]:
    return {"_type": STATEMENT_TYPE, "subject": [{"name": s.name, "digest": {"sha256": s.sha256}} for s in subjects],
            "predicateType": predicate_type, "predicate": predicate}


def sign(stmt: dict[str, Any], key: Any = None) -> dict[str, Any]:
    """A DSSE envelope holding `stmt`, signed with `key` (default: `signing_key()`)."""
    key = key or signing_key()
    body = json.dumps(stmt, sort_keys=True, separators=(",", ":")).encode()
    sig = key.sign(pae(PAYLOAD_TYPE, body))
    return {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(body).decode(),
            "signatures": [{"keyid": key_id(key.public_key()), "sig": base64.b64encode(sig).decode()}]}


@dataclass(frozen=True)
class Verified:
    statement: dict[str, Any]
    key_id: str

    @property
    def predicate(self) -> dict[str, Any]:
        return self.statement.get("predicate", {})

    def subjects(self) -> dict[str, str]:
        return {s["name"]: s["digest"]["sha256"] for s in self.statement.get("subject", [])}


def verify(envelope: Any, predicate_type: str, what: str, keys: dict[str, Any] | None = None) -> Verified:
    """The statement inside `envelope`, once a signature on it verifies under a trusted key and it is
    a statement of `predicate_type`; else NotVerified naming `what` and the reason."""
    from cryptography.exceptions import InvalidSignature

    keys = trusted_keys() if keys is None else keys
    try:
        body = base64.b64decode(envelope["payload"], validate=True)
        sigs = list(envelope["signatures"])
        if envelope["payloadType"] != PAYLOAD_TYPE:
            raise ValueError(f"payload type {envelope['payloadType']!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise NotVerified(f"{what}: not a signed statement ({e})") from None
    seen = []
    for s in sigs:
        kid = s.get("keyid", "") if isinstance(s, dict) else ""
        seen.append(kid[:12] or "?")
        if kid not in keys:
            continue
        try:
            keys[kid].verify(base64.b64decode(s["sig"]), pae(PAYLOAD_TYPE, body))
        except (InvalidSignature, KeyError, TypeError, ValueError):
            raise NotVerified(f"{what}: the signature by key {kid[:12]} does not match its content "
                              "(the statement was changed after it was signed)") from None
        stmt = json.loads(body)
        if stmt.get("_type") != STATEMENT_TYPE or stmt.get("predicateType") != predicate_type:
            raise NotVerified(f"{what}: a signed statement of another kind ({stmt.get('predicateType')})")
        return Verified(stmt, kid)
    raise NotVerified(f"{what}: signed by {', '.join(seen) or 'no key'}, which this machine does not trust "
                      f"(trusted: {', '.join(k[:12] for k in keys)}; add a team key with ${TRUSTED_KEYS_ENV})")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
