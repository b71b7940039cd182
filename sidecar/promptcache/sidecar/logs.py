"""Structured logs: one JSON object per line (or plain text), with the `extra=` fields of each call.

A log line may quote what a client sent (a model name, a pod name, an exception's message). In JSON every
control character is escaped by the encoder. In text, control characters (a newline that would start a forged
line, an ANSI escape that rewrites the terminal), line and paragraph separators and bidirectional overrides are
written as Python escapes (\\n, \\x1b, \\u202e), an `extra=` value that is not a plain word is quoted (so
`model_id=x chunks=999` cannot pose as two fields), and the lines of a traceback are indented under the record:
a line that starts at column 0 is always a record's first line."""
from __future__ import annotations

import json
import logging
import re
import sys
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

# C0 and C1 controls, DEL, the line and paragraph separators, the bidirectional embeddings/overrides/isolates
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_UNSAFE_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_WORD = re.compile(r"[^\s\"=\\]*")  # an extra= value written as it is: no blank, quote, '=' or backslash


def _escape_one(match: re.Match) -> str:
    c = match.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100
                                                              else f"\\u{ord(c):04x}")


def escape(text: str) -> str:
    """`text` with every character that could end a log line, rewrite a terminal or reorder what is shown
    written as a Python escape (printable text, other languages included, is kept as it is)."""
    return _UNSAFE.sub(_escape_one, text)


def _value(v) -> str:
    """An extra= value: as it is when a plain word, else quoted (JSON-style) and escaped."""
    text = str(v)
    if _WORD.fullmatch(text) and not _UNSAFE.search(text):
        return text
    return escape(json.dumps(text, ensure_ascii=False))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{escape(str(k))}={_value(v)}" for k, v in vars(record).items() if k not in _STANDARD)
        line = f"{self.formatTime(record)} {record.levelname:7} {record.name}: {escape(record.getMessage())}"
        line = f"{line} {extra}".rstrip()
        if record.exc_info:
            trace = _UNSAFE_BUT_NEWLINE.sub(_escape_one, self.formatException(record.exc_info))
            line += "".join("\n  " + part for part in trace.split("\n"))
        return line


def configure(level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
