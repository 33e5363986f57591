"""Unsent text per conversation: the message box holds the open chat's draft, and each chat keeps its own
through switches, Ctrl+N and restarts (a JSON file beside the conversations)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from runtime import paths

log = logging.getLogger("moedesk.drafts")
NEW = "new"       # the key of the chat not saved yet (no id before its first message)


def drafts_path() -> Path:
    return paths.data_dir() / "drafts.json"


class Drafts:
    def __init__(self, path: Optional[Path] = None):
        self.path = path or drafts_path()
        self._texts: dict[str, str] = {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            self._texts = {str(k): v for k, v in data.items() if isinstance(v, str) and v}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError) as e:    # a damaged file loses drafts, nothing else
            log.warning("drafts in %s could not be read (%s); starting without them", self.path, e)

    @staticmethod
    def key(conversation_id: Optional[int]) -> str:
        return NEW if conversation_id is None else str(conversation_id)

    def get(self, conversation_id: Optional[int]) -> str:
        return self._texts.get(self.key(conversation_id), "")

    def put(self, conversation_id: Optional[int], text: str) -> None:
        k = self.key(conversation_id)
        if text.strip():
            self._texts[k] = text
        else:
            self._texts.pop(k, None)

    def save(self) -> None:
        """Written whole through a temporary file, so a crash never leaves half a file."""
        tmp = self.path.with_suffix(".json.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self._texts, ensure_ascii=False), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("drafts could not be saved to %s: %s", self.path, e)
