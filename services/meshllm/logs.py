"""Process logging: one format per service, and no credential in any line.

    setup_logging("%(name)s")        # level from MESHLLM_LOG_LEVEL (INFO), on stderr, redacting
    redact_url("nats://u:pw@h:4222") # 'nats://u:***@h:4222'

URLs may carry credentials in their user-info part (`nats://user:pass@host`,
`nats://TOKEN@host`, `https://user:pass@etcd:2379`). Every place that prints
a URL passes it through `redact_url`; the filter that `setup_logging` puts on
the root handlers redacts whatever still slips through (a third-party
library's message, an exception text), so a secret given in a URL never
reaches a log line.
"""

from __future__ import annotations

import logging
import os
import re
import sys

__all__ = ["REDACTED", "RedactingFilter", "redact_text", "redact_url", "setup_logging"]

REDACTED = "***"
# scheme://userinfo@ — userinfo without '/', '@' or whitespace (RFC 3986 allows neither '/' nor '@' unescaped there)
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^/@\s]+)@")


def _mask(match: re.Match[str]) -> str:
    user, sep, _ = match.group(2).partition(":")
    # `user:password` keeps the user (it says who connected); a lone `TOKEN@` is a secret as a whole.
    return f"{match.group(1)}{user}:{REDACTED}@" if sep else f"{match.group(1)}{REDACTED}@"


def redact_url(url: str) -> str:
    """`url` with the password (or the token standing as user) of its user-info replaced by `***`."""
    return _USERINFO.sub(_mask, url) if "@" in url else url


def redact_text(text: str) -> str:
    """Every URL's credentials in `text` replaced by `***` (see `redact_url`)."""
    return _USERINFO.sub(_mask, text) if "@" in text else text


class RedactingFilter(logging.Filter):
    """Rewrites a record whose message (or exception text) holds a URL with credentials."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "@" in message:
            redacted = redact_text(message)
            if redacted != message:
                record.msg, record.args = redacted, None
        if record.exc_info and record.exc_info[1] is not None and "@" in str(record.exc_info[1]):
            # the formatted traceback would print the exception's text: format it once, redacted
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True


def setup_logging(who: str = "%(name)s") -> None:
    """Log to stderr at MESHLLM_LOG_LEVEL (default INFO) as `TIME LEVEL WHO: MESSAGE`, credentials redacted."""
    level = os.environ.get("MESHLLM_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s {who}: %(message)s", stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
