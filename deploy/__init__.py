"""kiln.deploy: serve, route and walk a canary under the gate policy (see docs/deploy.md).

router.py / proxy.py (`kiln route`, admission from engine/serve/admission.py, shared with `kiln serve`),
base.py (the deploy-target contract) with local.py and kubernetes.py, canary.py (the controller)
with live_gate.py and sequential.py, run.py (CLI entry points).
"""
