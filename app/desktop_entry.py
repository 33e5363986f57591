"""`moedesk --install-desktop-entry`: put MoE Desk in the desktop's application menu (Linux, XDG).

For installs from pip or a checkout; the bundle's own installer does the same for the bundle. Writes
`applications/moedesk.desktop` and the scalable icon under $XDG_DATA_HOME (default ~/.local/share),
with Exec pointing at the launcher that is running now, so the entry starts this installation.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from app.resources import resource

from runtime import tuning


def data_home() -> Path:
    return tuning.xdg_data_home()


def launcher_command() -> str:
    """The command that starts this installation of the app, quoted for a desktop entry's Exec key."""
    if getattr(sys, "frozen", False):
        return shlex.quote(str(Path(sys.executable).resolve()))
    found = shutil.which("moedesk")
    if found:
        return shlex.quote(str(Path(found).resolve()))
    return f"{shlex.quote(sys.executable)} -m app.main"


def render_entry(exec_cmd: str) -> str:
    lines = []
    for line in resource("moedesk.desktop").read_text(encoding="utf-8").splitlines():
        if line.startswith("Exec="):
            line = f"Exec={exec_cmd} %U"
        elif line.startswith("TryExec="):
            first = shlex.split(exec_cmd)[0]
            line = f"TryExec={first}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def install(target: Path | None = None) -> Path:
    """Install the entry and icon; returns the path of the written .desktop file."""
    base = target or data_home()
    apps = base / "applications"
    icons = base / "icons" / "hicolor" / "scalable" / "apps"
    apps.mkdir(parents=True, exist_ok=True)
    icons.mkdir(parents=True, exist_ok=True)
    entry = apps / "moedesk.desktop"
    tmp = entry.with_suffix(".desktop.tmp")
    tmp.write_text(render_entry(launcher_command()), encoding="utf-8")
    os.replace(tmp, entry)
    shutil.copyfile(resource("icons", "moedesk.svg"), icons / "moedesk.svg")
    if shutil.which("update-desktop-database"):
        subprocess.run(["update-desktop-database", str(apps)], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return entry
