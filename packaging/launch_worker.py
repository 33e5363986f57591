"""Bundle entry point: the engine worker process (moedesk-worker), started by the app."""
import sys

from runtime.worker import main

sys.exit(main())
