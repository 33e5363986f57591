"""The open conversation's logic: send, stream, stop, regenerate, edit-and-resend, continue, versions,
fork, save as it streams.

`ChatSession` knows the store and the message model, not the engine: it asks for work through its
`generate_requested` / `cancel_requested` signals and is told what happened through its `on_*` slots.
`app/main.py` connects both ends to the engine client in its one wiring block.

Streaming text is kept in memory and written to the store every `FLUSH_MS` while it changes, so a
crash loses at most that much; the final text, state and stats are written at once when the answer
ends (finished, error, or the worker dying).

An answer belongs to its chat: each chat has at most one answer in progress (`streams`, by chat id),
and Stop stops the open chat's own. A message sent in another chat while one is being answered waits
for the engine (the engine client keeps it until the running answer ends): its answer shows as
"queued" (`QUEUED`, in the view only; the store says "streaming") and the status line says so.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Optional

from PySide6.QtCore import QObject, QTimer, Signal

from app.chat.markdown import strip_thinking
from app.chat.model import QUEUED, ChatItem, MessageListModel
from app.store import Conversation, Store
from runtime.options import SamplingOptions
from runtime.protocol import ChatMessage, Finished, TokenDelta, WorkerError

FLUSH_MS = 500
TITLE_CHARS = 48


def title_from(text: str) -> str:
    """A chat's title from its first message: the first line, cut at a word boundary with "…" when long."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if len(line) <= TITLE_CHARS:
        return line or "New chat"
    cut = line[:TITLE_CHARS - 1]
    if not line[TITLE_CHARS - 1].isspace() and " " in cut:     # do not end inside a word
        cut = cut[:cut.rindex(" ")]
    return cut.rstrip(" ,;:.-") + "…"


@dataclass
class _Stream:
    request_id: str
    message_id: int
    conversation_id: int
    text: str = ""
    dirty: bool = False
    cancelling: bool = False
    queued: bool = False          # another chat's answer was asked for first and has not ended


class ChatSession(QObject):
    generate_requested = Signal(str, object, object, str)  # request id, tuple[ChatMessage], SamplingOptions,
                                                           # the answer so far (Continue) or ""
    cancel_requested = Signal(str)                     # request id
    conversation_changed = Signal(object)              # the open Conversation, or None
    conversations_changed = Signal()                   # titles or order changed: refresh the list
    busy_changed = Signal(bool)                        # the open chat's answer started or ended
    notice = Signal(str)                               # a short line for the status bar

    def __init__(self, store: Store, default_sampling: SamplingOptions = SamplingOptions(), parent=None):
        super().__init__(parent)
        self.store = store
        self.default_sampling = default_sampling
        self.model = MessageListModel(self)
        self.conversation: Optional[Conversation] = None
        self.model_name = ""                    # the loaded model, recorded on each answer
        self.streams: dict[int, _Stream] = {}    # chat id -> its answer in progress, in the order asked
        self._issued: set[str] = set()           # request ids this session asked for
        self._flush = QTimer(self, interval=FLUSH_MS, timeout=self.flush)

    @property
    def stream(self) -> Optional[_Stream]:
        """The open chat's answer in progress, if any."""
        return self.streams.get(self.conversation.id) if self.conversation is not None else None

    @property
    def busy(self) -> bool:
        """The open chat has an answer in progress (its Send becomes Stop)."""
        return self.stream is not None

    @property
    def generating(self) -> bool:
        """Some chat has an answer in progress."""
        return bool(self.streams)

    def writing(self) -> dict[int, str]:
        """Chat id -> "writing" or "queued", for every chat with an answer in progress."""
        return {cid: QUEUED if s.queued else "writing" for cid, s in self.streams.items()}

    def _stream_of(self, request_id: str) -> Optional[_Stream]:
        return next((s for s in self.streams.values() if s.request_id == request_id), None)

    def issued(self, request_id: str) -> bool:
        """Whether a request (and so an error about it) belongs to this chat."""
        return request_id in self._issued

    # -- conversations --------------------------------------------------------------------------
    def open(self, conversation_id: Optional[int]) -> None:
        self.conversation = self.store.conversation(conversation_id) if conversation_id is not None else None
        self.model.set_messages(self.store.messages(conversation_id) if conversation_id is not None else [])
        s = self.stream
        if s is not None:
            self.model.update(self.model.row_of(s.message_id), content=s.text, state=self._shown_state(s))
        self.conversation_changed.emit(self.conversation)

    def new_conversation(self) -> None:
        """An empty chat; it is written to the store with its first message."""
        self.open(None)

    def rename(self, conversation_id: int, title: str) -> None:
        self.store.rename_conversation(conversation_id, title)
        if self.conversation is not None and self.conversation.id == conversation_id:
            self.conversation = self.store.conversation(conversation_id)
            self.conversation_changed.emit(self.conversation)
        self.conversations_changed.emit()

    def pin(self, conversation_id: int, pinned: bool) -> None:
        """Pinned chats are listed on top, whatever their date."""
        self.store.set_pinned(conversation_id, pinned)
        if self.conversation is not None and self.conversation.id == conversation_id:
            self.conversation = self.store.conversation(conversation_id)
        self.conversations_changed.emit()

    def delete(self, conversation_id: int) -> None:
        s = self.streams.get(conversation_id)
        if s is not None:
            self._cancel(s)
            self._end_stream(s, "cancelled")
        self.store.delete_conversation(conversation_id)
        if self.conversation is not None and self.conversation.id == conversation_id:
            self.open(None)
        self.conversations_changed.emit()

    def set_settings(self, system_prompt: str, sampling: Optional[SamplingOptions], preset: str = "") -> None:
        if self.conversation is None:
            self.conversation = self.store.create_conversation(system_prompt=system_prompt, sampling=sampling,
                                                               preset=preset)
            self.conversations_changed.emit()
        else:
            self.store.set_conversation_settings(self.conversation.id, system_prompt, sampling, preset)
            self.conversation = self.store.conversation(self.conversation.id)
        self.conversation_changed.emit(self.conversation)

    def sampling(self) -> SamplingOptions:
        c = self.conversation
        return c.sampling if c is not None and c.sampling is not None else self.default_sampling

    # -- asking for answers ---------------------------------------------------------------------
    def send(self, text: str) -> bool:
        text = text.strip()
        if not text:
            return False
        if self.busy:
            self.notice.emit("An answer is still being written in this chat: wait for it or press Stop (Esc).")
            return False
        if self.conversation is None:
            title = title_from(text)
            self.conversation = self.store.create_conversation(title, model=self.model_name)
            self.conversation_changed.emit(self.conversation)
        elif not self.model.items and self.conversation.title == "New chat":
            self.store.rename_conversation(self.conversation.id, title_from(text))
            self.conversation = self.store.conversation(self.conversation.id)
            self.conversation_changed.emit(self.conversation)
        m = self.store.add_message(self.conversation.id, "user", text)
        self.model.append(ChatItem.from_message(m))
        self._answer()
        return True

    def regenerate(self, message_id: Optional[int] = None) -> bool:
        """A new version of the last answer (or of the answer `message_id`); the old one stays a version.
        A chat that ends with a question (e.g. a fork) gets its answer."""
        if self.busy or self.conversation is None or not self.model.items:
            return False
        if message_id is None:
            last = self.model.items[-1]
            if last.role == "user":
                self._answer()
                return True
            if last.role != "assistant":
                return False
            message_id = last.id
        row = self.model.row_of(message_id)
        slot = self.store.supersede(self.conversation.id, message_id)
        self.model.truncate(row)
        self._answer(slot)
        return True

    def edit_and_resend(self, message_id: int, text: str) -> bool:
        """Change a user message, drop everything after it, and ask again."""
        text = text.strip()
        if self.busy or self.conversation is None or not text:
            return False
        row = self.model.row_of(message_id)
        if self.model.items[row].role != "user":
            raise ValueError(f"message {message_id} is not the user's: only user messages can be edited")
        slot = self.store.supersede(self.conversation.id, message_id)
        m = self.store.add_message(self.conversation.id, "user", text, slot=slot)
        self.model.truncate(row)
        self.model.append(ChatItem.from_message(self._with_versions(m)))
        self._answer()
        return True

    def continue_answer(self, message_id: Optional[int] = None) -> bool:
        """Let the model go on writing a stopped answer (the last one) in the same message."""
        items = self.model.items
        if self.busy or self.conversation is None or not items:
            return False
        last = items[-1]
        if last.role != "assistant" or (message_id is not None and last.id != message_id) \
                or last.state not in ("cancelled", "error", "done") or not last.content:
            return False
        history = self.history()[:-1]              # up to the question; the answer so far is the prefix
        self.store.update_message(last.id, state="streaming", error="")
        s = self._start_stream(last.id, last.content)
        self.model.update(len(items) - 1, state=self._shown_state(s), error="")
        self.generate_requested.emit(s.request_id, history, self.sampling(), last.content)
        return True

    def show_version(self, message_id: int, step: int) -> bool:
        """Show the previous (step -1) or next (+1) version of a message, with what followed it."""
        if self.busy or self.conversation is None:
            return False
        it = self.model.items[self.model.row_of(message_id)]
        ids = self.store.versions(self.conversation.id, it.slot)
        i = ids.index(message_id) + step
        if not 0 <= i < len(ids):
            return False
        self.store.show_version(self.conversation.id, message_id, ids[i])
        self.model.set_messages(self.store.messages(self.conversation.id))
        self.conversation_changed.emit(self.conversation)
        return True

    def fork(self, message_id: int) -> None:
        """A new chat with this chat's messages up to and including `message_id`, opened."""
        if self.conversation is None:
            return
        fork = self.store.fork_conversation(self.conversation.id, message_id)
        self.open(fork.id)
        self.conversations_changed.emit()
        self.notice.emit(f"Forked into “{fork.title}”.")

    def _with_versions(self, m):
        """`m` with its place among its slot's versions (add_message does not count them)."""
        ids = self.store.versions(m.conversation_id, m.slot)
        return dataclasses.replace(m, version=ids.index(m.id) + 1, versions=len(ids))

    def stop(self) -> None:
        """Stop the open chat's answer (never another chat's)."""
        if self.stream is not None:
            self._cancel(self.stream)

    def _cancel(self, s: _Stream) -> None:
        if not s.cancelling:
            s.cancelling = True
            self.cancel_requested.emit(s.request_id)

    def _answer(self, slot: Optional[int] = None) -> None:
        conv = self.conversation
        if self.model_name and conv.model != self.model_name:       # a chat remembers its model
            self.store.set_conversation_model(conv.id, self.model_name)
            self.conversation = conv = self.store.conversation(conv.id)
        history = self.history()
        m = self.store.add_message(conv.id, "assistant", "", model=self.model_name, state="streaming", slot=slot)
        s = self._start_stream(m.id, "")
        item = ChatItem.from_message(self._with_versions(m) if slot is not None else m)
        item.state = self._shown_state(s)
        self.model.append(item)
        self.generate_requested.emit(s.request_id, history, self.sampling(), "")

    def _start_stream(self, message_id: int, text: str) -> _Stream:
        ahead = next(iter(self.streams.values()), None)        # another chat's answer, asked for first
        s = _Stream(f"chat-{uuid.uuid4().hex[:10]}", message_id, self.conversation.id, text, queued=ahead is not None)
        self.streams[s.conversation_id] = s
        self._issued.add(s.request_id)
        self._flush.start()
        if ahead is not None:
            title = self.store.conversation(ahead.conversation_id).title
            self.notice.emit(f"Queued: the answer in “{title}” is being written; this one starts when it ends.")
        self.busy_changed.emit(True)
        self.conversations_changed.emit()
        return s

    @staticmethod
    def _shown_state(s: _Stream) -> str:
        return QUEUED if s.queued else "streaming"

    def history(self, upto: Optional[int] = None) -> tuple[ChatMessage, ...]:
        """The chat as a request sends it (the messages before row `upto`, when given)."""
        out = []
        if self.conversation is not None and self.conversation.system_prompt.strip():
            out.append(ChatMessage("system", self.conversation.system_prompt))
        for it in self.model.items[:upto]:
            content = strip_thinking(it.content) if it.role == "assistant" else it.content
            if content:
                out.append(ChatMessage(it.role, content))
        return tuple(out)

    # -- what the engine says -------------------------------------------------------------------
    def on_token(self, ev: TokenDelta) -> None:
        s = self._stream_of(ev.request_id)
        if s is None:
            return
        if s.queued:                              # its turn came
            self._set_queued(s, False)
        s.text += ev.text
        s.dirty = True
        row = self._row(s)
        if row is not None:
            self.model.append_text(row, ev.text)

    def on_finished(self, ev: Finished) -> None:
        s = self._stream_of(ev.request_id)
        if s is None:
            return
        if ev.stats.dropped_messages:
            self.notice.emit(f"The chat outgrew the model's context: the oldest {ev.stats.dropped_messages} "
                             f"messages were left out of this answer's prompt.")
        self._end_stream(s, "cancelled" if ev.reason == "cancelled" else "done", stats=ev.stats)

    def on_error(self, request_id: str, err: WorkerError) -> None:
        s = self._stream_of(request_id)
        if s is not None:
            self._end_stream(s, "error", error=err.message)

    def on_worker_died(self, exit_code: int, words: str, stderr_lines: list) -> None:
        for s in list(self.streams.values()):
            self._end_stream(s, "error", error=words)

    def fail_request(self, request_id: str, words: str) -> None:
        """The request could not even be sent (no engine running), or its engine was let go."""
        s = self._stream_of(request_id)
        if s is not None:
            self._end_stream(s, "error", error=words)

    def flush(self) -> None:
        for s in self.streams.values():
            if s.dirty:
                self.store.update_message(s.message_id, content=s.text)
                s.dirty = False

    def _end_stream(self, s: _Stream, state: str, stats=None, error: str = "") -> None:
        del self.streams[s.conversation_id]
        if not self.streams:
            self._flush.stop()
        self.store.update_message(s.message_id, content=s.text, state=state, stats=stats,
                                  error=error if state == "error" else None)
        row = self._row(s)
        if row is not None:
            self.model.update(row, content=s.text, state=state, stats=stats, error=error or None)
        nxt = next(iter(self.streams.values()), None)
        if nxt is not None and nxt.queued:       # the next chat's answer runs now
            self._set_queued(nxt, False)
        self.busy_changed.emit(self.busy)
        self.conversations_changed.emit()

    def _set_queued(self, s: _Stream, queued: bool) -> None:
        s.queued = queued
        row = self._row(s)
        if row is not None:
            self.model.update(row, state=self._shown_state(s))
        self.conversations_changed.emit()        # the chat list's mark: queued -> writing

    def _row(self, s: _Stream) -> Optional[int]:
        """The row of `s`'s answer when its chat is the open one."""
        if self.conversation is None or self.conversation.id != s.conversation_id:
            return None
        last = len(self.model.items) - 1
        if last >= 0 and self.model.items[last].id == s.message_id:
            return last
        return self.model.row_of(s.message_id)

