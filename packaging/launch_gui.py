"""Bundle entry point: the desktop app (moedesk)."""
import sys

from app.main import main

sys.exit(main())
