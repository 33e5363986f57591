"""Unload the local engine's model after a while without requests (Settings → General → Unload when idle),
and load it again, with the same options, before the next request.

    unloader = IdleUnloader(client)             # client: app.engine_client.EngineClient
    unloader.set_minutes(settings.app.unload_idle_minutes)       # 0: never
    unloader.wake()                             # before a chat's or the local server's request
    unloader.words                              # what the last idle unload did, in words (for the banner)

The count starts when the engine becomes idle with a model loaded and starts again after every
answer (a chat's or the local server's); loading, an answer or a waiting request stop it. While the
model sleeps (`asleep`) the chat can send and the server keeps serving its name: the first request
loads it again (the worker runs the load, then the request, in order). Loading or ejecting a model
by hand ends the sleep (`forget`).
"""
from __future__ import annotations

from typing import Optional

from PySide6.QtCore import QObject, QTimer

from runtime import paths
from runtime.options import LoadOptions


class IdleUnloader(QObject):
    def __init__(self, client, parent=None):
        super().__init__(parent)
        self.client = client
        self.seconds = 0.0
        self.asleep: Optional[tuple[str, LoadOptions]] = None    # what was unloaded, to load again
        self.words = ""                  # what happened, in words (the last idle unload)
        self._timer = QTimer(self, singleShot=True)
        self._timer.timeout.connect(self._unload)
        client.state_changed.connect(lambda _state: self._arm())
        client.loaded.connect(self._on_loaded)

    def set_minutes(self, minutes: float) -> None:
        self.seconds = max(0.0, float(minutes)) * 60
        self._arm()

    def wake(self) -> bool:
        """Load the sleeping model again (before a request); True when a load was sent."""
        if self.asleep is None:
            return False
        model, options = self.asleep
        self.asleep = None
        self.client.load(model, options)
        return True

    def forget(self) -> None:
        """A model was loaded or ejected by hand: nothing sleeps any more."""
        self.asleep = None

    def _on_loaded(self, _ev) -> None:
        self.asleep = None
        self._arm()

    def _idle(self) -> bool:
        c = self.client
        return (c.state == "idle" and c.loaded_event is not None and c.last_load is not None and not c.generating
                and not c.loading)

    def _arm(self) -> None:
        if self.seconds > 0 and self._idle():
            self._timer.start(int(self.seconds * 1000))
        else:
            self._timer.stop()

    def _unload(self) -> None:
        if not self._idle():
            return
        self.asleep = self.client.last_load
        self.client.unload()
        name = paths.display_name(self.asleep[0])
        minutes = self.seconds / 60
        after = f"{minutes:g} minute{'s' if minutes != 1 else ''}" if minutes >= 1 else f"{self.seconds:g} s"
        self.words = (f"{name} was unloaded after {after} without requests, freeing its memory; "
                      f"the next message or API request loads it again.")
