"""URLs as they may be shown: credentials and secret-looking query parameters masked."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
SECRET_PARAM_WORDS = ("key", "token", "secret", "password", "passwd", "auth", "sig", "credential")


def redact_url(url: str) -> str:
    """``http://user:pw@host/p?api_key=x&a=1`` -> ``http://***@host/p?api_key=***&a=1``."""
    try:
        u = urlsplit(url)
    except ValueError:
        return MASK
    netloc = u.netloc
    if "@" in netloc:
        netloc = MASK + "@" + netloc.rsplit("@", 1)[1]
    query = u.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, MASK if any(w in k.lower() for w in SECRET_PARAM_WORDS) else v) for k, v in pairs],
                          safe="*")
    return urlunsplit((u.scheme, netloc, u.path, query, u.fragment))
