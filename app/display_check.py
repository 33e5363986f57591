"""Before the window opens on X11: the system libraries Qt's xcb platform plugin links, checked by name.

Without them Qt aborts with "Could not load the Qt platform plugin "xcb"" and a list of plugins, which
tells a user nothing. `missing_for_display()` tries to load each library as the plugin would (the
dynamic loader's own search, so a bundle's copies count) and names the Debian/Ubuntu packages that
provide the missing ones. The list is what `ldd` shows for PySide6's `plugins/platforms/libqxcb.so` and
`lib/libQt6XcbQpa.so.6` (Qt 6.5 and later; older Qt needs a subset).
"""
from __future__ import annotations

import ctypes
import sys
from typing import Callable, Mapping, Optional

from runtime import tuning

# soname -> Debian/Ubuntu package
XCB_LIBRARIES: dict[str, str] = {
    "libxcb.so.1": "libxcb1",
    "libX11.so.6": "libx11-6",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
}


def _loads(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def uses_xcb(environ: Mapping[str, str] = tuning.environment(), platform: str = sys.platform) -> bool:
    """Whether Qt will open its window through X11 (xcb): Linux, a DISPLAY, and no other platform asked for."""
    if not platform.startswith("linux"):
        return False
    asked = environ.get("QT_QPA_PLATFORM", "")
    if asked:
        return asked.split(":")[0] == "xcb"
    return bool(environ.get("DISPLAY")) and not environ.get("WAYLAND_DISPLAY")


def missing_for_display(loads: Optional[Callable[[str], bool]] = None) -> list[str]:
    """The packages whose libraries the xcb plugin needs and the loader cannot find."""
    loads = loads or _loads
    return sorted({pkg for soname, pkg in XCB_LIBRARIES.items() if not loads(soname)})


def advice(missing: list[str]) -> Optional[str]:
    if not missing:
        return None
    return ("MoE Desk cannot open its window: the X11 libraries Qt needs are missing "
            f"({', '.join(missing)}).\nInstall them, then start MoE Desk again:\n"
            f"    sudo apt-get install {' '.join(missing)}\n"
            "(Fedora: sudo dnf install xcb-util-cursor xcb-util-wm xcb-util-keysyms xcb-util-image "
            "xcb-util-renderutil libxkbcommon-x11)")
