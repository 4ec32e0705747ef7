"""kiln's offline demo: the model and data built from registry packages, cached once."""
