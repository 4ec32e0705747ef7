"""The `kiln` command line: typer commands, one module per group of commands."""
