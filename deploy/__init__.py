"""kiln.deploy: serve, route and walk a canary under the gate policy (see docs/deploy.md).

router.py / proxy.py (`kiln route`, admission from engine/serve/admission.py, shared with `kiln serve`),
base.py (the deploy-target contract) with local.py and kubernetes.py, registered by name in
targets.py, canary.py (the controller) with live_gate.py and sequential.py, run.py (CLI entry points).

Importing the package registers every deploy target (as kiln.optimize and kiln.engine register theirs),
so `deploy.target` is checked against all of them whichever module a caller imports first.
"""

from kiln.deploy import kubernetes, local  # noqa: F401  (registers the deploy targets)
