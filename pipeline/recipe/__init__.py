"""The recipe: its schema and rules, candidate grids, the gate policy's digest, the model's source."""
