"""Message text to the HTML subset that QTextDocument renders: Markdown, highlighted code, thinking.

`render(text, ...)` returns a `Rendered`: the HTML, the source of each code block (for its Copy
link), and how many `<think>` sections there are.

The app's own links (a message's Copy / Edit / Regenerate, a code block's Copy, a thinking fold) use a
scheme drawn at random once per process, `app_link(kind, n)`, which `app_action(href)` reads back: message
text (written by the model, or pasted by the user) cannot name it, so no link in a message is ever an app
button. Links in message text are kept only for http(s); any other Markdown link or autolink stays text.
Raw HTML in a message is shown as text too (markdown-it with `html=False`): a model's answer can never
inject markup. A `<think>` without its closing tag (still streaming) runs to the end of the text.
"""
from __future__ import annotations

import html
import re
import secrets
from dataclasses import dataclass, field
from functools import lru_cache

from markdown_it import MarkdownIt
from pygments import highlight as _pygments_highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
APP_SCHEME = f"moedesk-{secrets.token_hex(16)}"      # the app's own links; unknown to anything that writes text
MESSAGE_LINK_SCHEMES = ("http", "https")             # links a message may carry (opened in the browser)
_INDEX = re.compile(r"[0-9]{1,6}")


def app_link(kind: str, n: int | None = None) -> str:
    """The href of one of the app's own buttons: kind copy | edit | regenerate | code (n) | think (n)."""
    return f"{APP_SCHEME}:{kind}" + ("" if n is None else f"/{n}")


def app_action(href: str) -> tuple[str, int | None] | None:
    """(kind, n) of an app link; None for any other href (a message's link), malformed ones included."""
    scheme, _, rest = href.partition(":")
    if scheme != APP_SCHEME:
        return None
    kind, slash, n = rest.partition("/")
    if not slash:
        return kind, None
    return (kind, int(n)) if _INDEX.fullmatch(n) else None


def _message_link(url: str) -> bool:
    return url.partition(":")[0].strip().lower() in MESSAGE_LINK_SCHEMES and ":" in url


@dataclass(frozen=True)
class Palette:
    """The colours the HTML needs; built from the Qt palette so both themes read well."""
    dark: bool = False
    text: str = "#1f2328"
    muted: str = "#6e7781"
    code_bg: str = "#f3f4f6"
    border: str = "#d0d7de"
    link: str = "#0969da"

    @property
    def pygments_style(self) -> str:
        return "monokai" if self.dark else "friendly"


LIGHT = Palette()
DARK = Palette(dark=True, text="#e6edf3", muted="#8d96a0", code_bg="#161b22", border="#30363d", link="#4493f8")


@dataclass
class Rendered:
    html: str
    code_blocks: list[str] = field(default_factory=list)
    thinks: int = 0


@dataclass(frozen=True)
class Segment:
    kind: str          # "text" | "think"
    text: str
    closed: bool = True


def split_thinking(text: str) -> list[Segment]:
    """The answer cut into plain text and `<think>` sections (the last may be unclosed)."""
    out: list[Segment] = []
    pos = 0
    while True:
        start = text.find(THINK_OPEN, pos)
        if start < 0:
            break
        if start > pos:
            out.append(Segment("text", text[pos:start]))
        end = text.find(THINK_CLOSE, start + len(THINK_OPEN))
        if end < 0:
            out.append(Segment("think", text[start + len(THINK_OPEN):], closed=False))
            return out
        out.append(Segment("think", text[start + len(THINK_OPEN):end]))
        pos = end + len(THINK_CLOSE)
    if pos < len(text):
        out.append(Segment("text", text[pos:]))
    return out


class _Renderer:
    """One markdown-it parser whose fence highlighter records each code block."""

    def __init__(self, palette: Palette):
        self.palette = palette
        self.blocks: list[str] = []
        self.formatter = HtmlFormatter(style=palette.pygments_style, noclasses=True, nowrap=True)
        self.md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
        self.md.enable("table").enable("strikethrough")
        self.md.validateLink = _message_link          # other schemes: the link stays text

        def fence(renderer, tokens, idx, options, env) -> str:
            token = tokens[idx]
            lang = token.info.strip().split(maxsplit=1)[0] if token.info.strip() else ""
            return self._code(token.content, lang)

        self.md.add_render_rule("fence", fence)
        self.md.add_render_rule("code_block", fence)

    def _code(self, code: str, lang: str) -> str:
        n = len(self.blocks)
        self.blocks.append(code.rstrip("\n"))
        lexer = _lexer(lang.lower())
        body = _pygments_highlight(code.rstrip("\n"), lexer, self.formatter)
        p = self.palette
        label = html.escape(lang or "code")
        # A one-cell table gives the block a background and padding in QTextDocument.
        return (f'<table width="100%" cellspacing="0" cellpadding="6" bgcolor="{p.code_bg}" '
                f'style="border: 1px solid {p.border}; margin-top: 4px; margin-bottom: 4px;">'
                f'<tr><td><span style="color:{p.muted}; font-size: small;">{label}</span>&nbsp;&nbsp;'
                f'<a href="{app_link("code", n)}" style="color:{p.link}; text-decoration: none; '
                f'font-size: small;">Copy</a>'
                f'<pre style="margin: 0;">{body}</pre></td></tr></table>\n')

    def markdown(self, text: str) -> str:
        return self.md.render(text)


@lru_cache(maxsize=64)
def _lexer(lang: str):
    try:
        return get_lexer_by_name(lang) if lang else TextLexer()
    except ClassNotFound:
        return TextLexer()


@lru_cache(maxsize=4)
def _renderer(palette: Palette) -> _Renderer:
    return _Renderer(palette)


def render(text: str, palette: Palette = LIGHT, expanded: frozenset[int] = frozenset(),
           plain: bool = False) -> Rendered:
    """HTML for one message. `expanded`: the thinking sections shown unfolded. `plain`: no Markdown
    (user messages keep their exact text, line breaks included)."""
    if plain:
        body = html.escape(text).replace("\n", "<br>")
        return Rendered(f'<p style="white-space: pre-wrap;">{body}</p>')
    r = _renderer(palette)
    r.blocks = []
    parts: list[str] = []
    thinks = 0
    for seg in split_thinking(text):
        if seg.kind == "text":
            parts.append(r.markdown(seg.text))
            continue
        n = thinks
        thinks += 1
        words = len(seg.text.split())
        state = "thinking…" if not seg.closed else f"thought for {words} words"
        arrow = "▾" if n in expanded else "▸"
        parts.append(f'<p><a href="{app_link("think", n)}" style="color:{palette.muted}; text-decoration: none;">'
                     f'{arrow} {state}</a></p>')
        if n in expanded:
            inner = r.markdown(seg.text)
            parts.append(f'<table width="100%" cellpadding="6" style="border-left: 3px solid {palette.border};">'
                         f'<tr><td style="color:{palette.muted};">{inner}</td></tr></table>')
    return Rendered("".join(parts), list(r.blocks), thinks)


_TAGS = re.compile(r"<[^>]+>")


def strip_thinking(text: str) -> str:
    """The answer without its thinking sections (what "Copy message" copies)."""
    return "".join(s.text for s in split_thinking(text) if s.kind == "text").strip()
