"""`moedesk`: the console script. `moedesk serve ...` runs the headless server without importing Qt;
anything else starts the desktop app (`app.main`)."""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from app.serve.cli import main as serve
        return serve(argv[1:])
    from app.main import main as gui
    return gui(argv)


if __name__ == "__main__":
    sys.exit(main())
