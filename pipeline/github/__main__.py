"""`python -m kiln.pipeline.github SUBCOMMAND`: the steps of kiln's GitHub workflow (publish.main)."""

import sys

from kiln.core.errors import BadInput
from kiln.pipeline.github.publish import main

try:
    sys.exit(main())
except BadInput as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(int(e.exit_code))
