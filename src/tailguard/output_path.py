"""Output files a command writes at the end of long work: checked before the work starts."""

from __future__ import annotations

from pathlib import Path


def unwritable(path: str | Path, make_parent: bool = False) -> str | None:
    """Why ``path`` cannot be written (a directory, a missing or read-only folder), or None when it can. Opening for
    append truncates nothing; a file made only for the check is removed. ``make_parent`` creates a missing folder."""
    out = Path(path)
    if out.is_dir():
        return "it is a directory"
    existed = out.exists()
    try:
        if make_parent:
            out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a", encoding="utf-8"):
            pass
        if not existed:
            out.unlink()
    except OSError as exc:
        return str(exc.strerror or exc)
    return None
