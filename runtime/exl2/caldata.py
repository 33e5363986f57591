"""Calibration data of the converter: exllamav2's standard set when it is installed, the shipped text otherwise.

exllamav2 (a dependency of the app) ships the texts its own converter calibrates on by default, in
`exllamav2/conversion/standard_cal_data/*.utf8`: web text (c4), Wikipedia, source code, children's
stories (tiny), several languages and technical prose. They are found through the import system's
package spec, without importing exllamav2 (whose import loads its CUDA extension). Rows are shared
between the sources in the proportions exllamav2 uses (about 10 c4 : 48 wiki : 15 code : 10 tiny :
20 multilingual : 10 technical) and cut from the start of each text, consecutive `seq_len`-token pieces.

Without exllamav2 the converter falls back to data/calibration.txt (about 2,000 tokens of public-domain
English) and says so: far too little for a good calibration of any real model.
"""
from __future__ import annotations

import hashlib
import importlib.util
import re
from pathlib import Path
from typing import Mapping

SHIPPED = Path(__file__).parent / "data" / "calibration.txt"
STANDARD_WEIGHTS = {"c4": 10, "wiki": 48, "code": 15, "tiny": 10, "multilingual": 20, "technical": 10}
CHARS_PER_TOKEN = 6          # generous: a source's text is tokenized in prefixes of this many chars a token
_WIKI_MARKUP = re.compile(r"^</?doc[^>]*>\n?", re.M)


class CalibrationDataError(ValueError):
    """Calibration text that cannot give the rows asked for; the message names the source."""


def standard_dir() -> Path | None:
    """exllamav2's standard_cal_data folder, or None when exllamav2 (or the folder) is not installed."""
    try:
        spec = importlib.util.find_spec("exllamav2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        folder = Path(base) / "conversion" / "standard_cal_data"
        if all((folder / f"{name}.utf8").is_file() for name in STANDARD_WEIGHTS):
            return folder
    return None


def standard_texts(folder: Path | None = None) -> dict[str, str] | None:
    """{source: text} of exllamav2's standard set (Wikipedia's <doc> markup removed), or None if absent."""
    folder = folder or standard_dir()
    if folder is None:
        return None
    texts = {name: (folder / f"{name}.utf8").read_text(encoding="utf-8") for name in STANDARD_WEIGHTS}
    texts["wiki"] = _WIKI_MARKUP.sub("", texts["wiki"])
    return texts


def default_texts() -> tuple[dict[str, str], str, str | None]:
    """-> ({source: text}, a name for the set, a note to show when it is the small fallback)."""
    texts = standard_texts()
    if texts is not None:
        return texts, "exllamav2-standard", None
    return ({SHIPPED.stem: SHIPPED.read_text(encoding="utf-8")}, SHIPPED.name,
            "exllamav2's standard calibration data is not installed; calibrating on the shipped English text "
            "(about 2,000 tokens), which is too little for a good result: pass --calibration FILE with more text")


def fingerprint(texts: str | Mapping[str, str]) -> str:
    if isinstance(texts, str):
        return hashlib.sha256(texts.encode()).hexdigest()
    h = hashlib.sha256()
    for name in sorted(texts):
        h.update(f"{name}\0{len(texts[name])}\0".encode())
        h.update(texts[name].encode())
    return h.hexdigest()


def share_rows(names, rows: int) -> dict[str, int]:
    """Rows per source in STANDARD_WEIGHTS' proportions (1 for other names), largest remainders first;
    every source gets a row when there are at least as many rows as sources."""
    weights = {n: STANDARD_WEIGHTS.get(n, 1) for n in names}
    total = sum(weights.values())
    exact = {n: rows * w / total for n, w in weights.items()}
    share = {n: int(x) for n, x in exact.items()}
    if rows >= len(weights):
        share = {n: max(1, k) for n, k in share.items()}
    for n in sorted(exact, key=lambda n: exact[n] - int(exact[n]), reverse=True):
        if sum(share.values()) >= rows:
            break
        share[n] += 1
    while sum(share.values()) > rows:                   # the minimum of one row overshot: take from the largest
        share[max(share, key=share.get)] -= 1
    return share


def token_rows(tokenizer, text: str, rows: int, seq_len: int, source: str):
    """[rows', seq_len] token ids from the start of the text (rows' <= rows: as many as it fills)."""
    import torch
    need, chars = rows * seq_len, rows * seq_len * CHARS_PER_TOKEN
    while True:
        ids = tokenizer(text[:chars], return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        if ids.numel() >= need or chars >= len(text):
            break
        chars *= 2
    n = min(rows, ids.numel() // seq_len)
    if n < 1:
        raise CalibrationDataError(f"{source}: calibration text has {ids.numel()} tokens; at least {seq_len} "
                                   f"are needed")
    return ids[: n * seq_len].view(n, seq_len).to(torch.int64)


def calibration_ids(tokenizer, texts: str | Mapping[str, str], rows: int, seq_len: int, source: str):
    """[rows', seq_len] token ids: one text cut into rows, or several sharing the rows (share_rows)."""
    import torch
    if isinstance(texts, str):
        return token_rows(tokenizer, texts, rows, seq_len, source)
    if not texts:
        raise CalibrationDataError(f"{source}: no calibration texts")
    parts = [token_rows(tokenizer, texts[name], k, seq_len, f"{source}/{name}")
             for name, k in share_rows(texts, rows).items() if k > 0]
    return torch.cat(parts, dim=0)
