"""python -m app.serve: the same as `moedesk serve`."""
import sys

from app.serve.cli import main

sys.exit(main())
