"""MLflow: the parent run and its children, the model registry's aliases, the UI, the canary journal."""
