"""The deploy targets by name: the recipe's `deploy.target` names one, `kiln deploy canary` starts it.

A target is one file beside base.py (local.py, kubernetes.py): a `DeployTarget` subclass registered
here with the options of the `deploy:` section it reads, e.g.

    @TARGETS.register("local", RouterOptions)
    class LocalTarget(DeployTarget): ...

and one import line in deploy/__init__.py, which imports every target so that the registry is full
before a recipe is validated. `DeployConfig.target` accepts the registered names (an unknown one is
BadInput with "Did you mean"), and `kiln.deploy.run.deploy_canary` resolves it here, opens the target
for the run (`DeployTarget.open`) and walks it (`DeployTarget.walk`).

This module imports nothing else of kiln.deploy: the recipe's section (config.py) reads it, and every
target imports that section, so the registry sits below both.
"""

from __future__ import annotations

from kiln.core.registry import Registry

TARGETS: Registry = Registry("deploy target", "target")  # name -> a DeployTarget subclass (base.py)
