"""The messages of the open conversation as a Qt list model.

Each streamed token changes one row's text: `append_text` emits `dataChanged` for that row and the
content role only, so views repaint one item and nothing else is recomputed. Only the GUI thread
touches this model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from PySide6.QtCore import QAbstractListModel, QModelIndex, QPersistentModelIndex, Qt

from app.store import Message
from runtime.protocol import GenerationStats

ContentRole = Qt.ItemDataRole.UserRole + 1
RoleRole = Qt.ItemDataRole.UserRole + 2         # "user" | "assistant" | "system"
StateRole = Qt.ItemDataRole.UserRole + 3        # "streaming" | "queued" | "done" | "error" | "cancelled"
StatsRole = Qt.ItemDataRole.UserRole + 4        # GenerationStats or None
ErrorRole = Qt.ItemDataRole.UserRole + 5        # words, when state is "error"
IdRole = Qt.ItemDataRole.UserRole + 6           # the store's message id
ModelNameRole = Qt.ItemDataRole.UserRole + 7
IsLastRole = Qt.ItemDataRole.UserRole + 8       # the last row (Regenerate is offered there)
ItemRole = Qt.ItemDataRole.UserRole + 9         # the whole ChatItem (one call for the delegate)
QUEUED = "queued"         # in the view only: the answer waits while another chat's answer is written
IN_PROGRESS = ("streaming", QUEUED)


@dataclass
class ChatItem:
    """One row; mutable because streaming grows `content` in place."""
    id: int
    role: str
    content: str
    state: str = "done"
    model: str = ""
    stats: Optional[GenerationStats] = None
    error: str = ""
    slot: int = 0                 # shared by every version of this message (the store's)
    version: int = 1              # shown as "‹ version/versions ›" when there are several
    versions: int = 1

    @classmethod
    def from_message(cls, m: Message) -> "ChatItem":
        return cls(m.id, m.role, m.content, m.state, m.model, m.stats, m.error, m.slot or m.id, m.version,
                   m.versions)


class MessageListModel(QAbstractListModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.items: list[ChatItem] = []

    # -- Qt interface ---------------------------------------------------------------------------
    def rowCount(self, parent: QModelIndex | QPersistentModelIndex = QModelIndex()) -> int:  # noqa: N802
        return 0 if parent.isValid() else len(self.items)

    def data(self, index: QModelIndex | QPersistentModelIndex, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self.items):
            return None
        it = self.items[index.row()]
        if role == ItemRole:
            return it
        if role in (Qt.ItemDataRole.DisplayRole, ContentRole):
            return it.content
        return {
            RoleRole: it.role, StateRole: it.state, StatsRole: it.stats, ErrorRole: it.error,
            IdRole: it.id, ModelNameRole: it.model, IsLastRole: index.row() == len(self.items) - 1,
        }.get(role)

    def roleNames(self) -> dict[int, bytes]:  # noqa: N802
        return {ContentRole: b"content", RoleRole: b"role", StateRole: b"state", StatsRole: b"stats",
                ErrorRole: b"error", IdRole: b"messageId", ModelNameRole: b"model", IsLastRole: b"isLast"}

    # -- changes --------------------------------------------------------------------------------
    def set_messages(self, messages: Iterable[Message]) -> None:
        self.beginResetModel()
        self.items = [ChatItem.from_message(m) for m in messages]
        self.endResetModel()

    def append(self, item: ChatItem) -> int:
        row = len(self.items)
        self.beginInsertRows(QModelIndex(), row, row)
        self.items.append(item)
        self.endInsertRows()
        if row > 0:
            self._changed(row - 1, [IsLastRole])
        return row

    def append_text(self, row: int, text: str) -> None:
        self.items[row].content += text
        self._changed(row, [ContentRole])

    def update(self, row: int, *, content: Optional[str] = None, state: Optional[str] = None,
               stats: Optional[GenerationStats] = None, error: Optional[str] = None) -> None:
        it = self.items[row]
        roles = []
        for name, value, role in (("content", content, ContentRole), ("state", state, StateRole),
                                  ("stats", stats, StatsRole), ("error", error, ErrorRole)):
            if value is not None:
                setattr(it, name, value)
                roles.append(role)
        if roles:
            self._changed(row, roles)

    def truncate(self, row: int) -> None:
        """Remove `row` and everything after it."""
        if row >= len(self.items):
            return
        self.beginRemoveRows(QModelIndex(), row, len(self.items) - 1)
        del self.items[row:]
        self.endRemoveRows()
        if self.items:
            self._changed(len(self.items) - 1, [IsLastRole])

    def row_of(self, message_id: int) -> int:
        for i in range(len(self.items) - 1, -1, -1):
            if self.items[i].id == message_id:
                return i
        raise KeyError(f"message {message_id} is not in the open conversation")

    def _changed(self, row: int, roles: list[int]) -> None:
        idx = self.index(row, 0)
        self.dataChanged.emit(idx, idx, roles)
