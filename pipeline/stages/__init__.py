"""The stages and their mechanism: content-addressed keys, cache, resume, MLflow children."""
