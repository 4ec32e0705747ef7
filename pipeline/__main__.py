"""`python -m kiln.pipeline` is the `kiln` command."""

from kiln.pipeline.cli.main import main

main()
