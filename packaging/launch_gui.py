"""Bundle entry point: the desktop app (moedesk)."""
import sys

from app.launch import main

sys.exit(main())
