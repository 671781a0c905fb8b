"""A record file replaced whole: written aside (`.<name>.<random>` in the
same directory), then renamed over the old one, so a reader on any replica
sees the old record or the new one, never half of one.  A writer that dies
between the two leaves only the file aside (its store may sweep `.<name>*`)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text)
    os.replace(tmp, path)
