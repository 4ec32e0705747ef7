"""kiln.core: the ground floor (docs/architecture.md); it imports no other kiln folder."""
