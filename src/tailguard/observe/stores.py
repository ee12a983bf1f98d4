"""Which request store a target names, and opening it: a SQLite file (a path, or ``sqlite:///path``) or a PostgreSQL
database (``postgresql://...``, which needs psycopg, imported only then). The backends share ``store.RequestStore``."""

from __future__ import annotations

import os
from typing import Any

from tailguard.observe.store import RequestStore, check_store_target, is_postgres_url


def describe_store_target(target: str | os.PathLike) -> str:
    """``target`` fit for a log line: a URL's password masked."""
    text = str(target)
    if not is_postgres_url(text):
        return text
    from tailguard.observe.store_pg import redact_url

    return redact_url(text)


def store_class(target: str | os.PathLike) -> type[RequestStore]:
    """The backend for ``target``: PostgreSQL for a postgresql:// URL, SQLite for a path or sqlite:/// URL."""
    check_store_target(target)
    if is_postgres_url(target):
        from tailguard.observe.store_pg import PostgresStore

        return PostgresStore
    from tailguard.observe.store_sqlite import SQLiteStore

    return SQLiteStore



def open_store(target: str | os.PathLike, **kwargs: Any) -> RequestStore:
    """Open the request store at ``target`` (a SQLite path or a postgresql:// URL); see ``store.RequestStore``."""
    return store_class(target)(target, **kwargs)
