"""Reading YAML a user hands kiln (a recipe file, a `--set` value) so that any bytes at all give a
result or one clear BadInput, never a traceback and never a hang.

`yaml.safe_load` alone raises UnicodeDecodeError on Latin-1 or UTF-16 files, RecursionError on
deeply nested flow collections, ValueError on a 5000-digit integer (Python's int-size guard), and
expands aliases into references that pydantic later walks one by one (a "billion laughs" recipe of
a few kilobytes never finishes validating). Each is turned into a message naming the file and fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kiln.core.errors import BadInput

MAX_BYTES = 1 << 20  # a recipe is a page or two of YAML; 1 MiB is generous
MAX_ALIASES = 100
MAX_DEPTH = 64


class _Loader(yaml.SafeLoader):
    """SafeLoader with a bound on aliases and on nesting depth (both checked while composing)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.aliases = 0
        self.depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise _Refused(f"more than {MAX_ALIASES} YAML aliases (*name); write the values out")
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _Refused(f"nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _Refused(Exception):
    pass


def parse(text: str, where: str) -> Any:
    """The YAML value of `text`; `where` names it in the error ("r.yaml", "--set a.b=…")."""
    if "\x00" in text or any("\ud800" <= c <= "\udfff" for c in text):
        raise BadInput(f"{where}: contains a NUL or an invalid (surrogate) character; use plain UTF-8 text")
    loader = None
    try:
        loader = _Loader(text)  # the reader refuses control characters already here
        return loader.get_single_data()
    except _Refused as e:
        raise BadInput(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise BadInput(f"{where}: not valid YAML: {e}") from None
    except RecursionError:
        raise BadInput(f"{where}: nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer of thousands of digits
        raise BadInput(f"{where}: a value YAML cannot hold: {str(e).splitlines()[0]}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_text(path: Path, what: str = "recipe") -> str:
    """A small UTF-8 text file's content, or BadInput saying what is wrong with its bytes."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise BadInput(f"{path}: {size / 1e6:.1f} MB is too large for a {what} (at most {MAX_BYTES >> 20} MiB)")
    data = path.read_bytes()
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise BadInput(f"{path}: the {what} is UTF-16; save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: the {what} is not UTF-8 (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                       "save it as UTF-8") from None
