"""kiln.evaluate.quality: the quality evals, one file each, and their contract and registry (base.py).

Importing the package registers every eval. The order of registration is the order the recipe lists
their sections (`kiln schema`) and the evaluate stage runs those of one phase: keep it.
"""

from kiln.evaluate.quality import perplexity, agreement, lmeval, served  # noqa: F401, I001 - registers, in order
