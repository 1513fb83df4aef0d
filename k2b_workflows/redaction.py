"""Keeping secrets off screens and out of stored or logged error texts.

Runs carry what users give them: an input may hold a password, an output a
card token, an exception text a URL with ``api_key=...``. The kernel stores
inputs and outputs as they are (replay needs them), but

- the admin shows every JSON value (inputs, outputs, principals, ledger
  details) through ``redact()``: values under a sensitive key, and anything
  that looks like a card number, are replaced by ``[redacted]``; idempotency
  keys and messages go through ``redact_text()``;
- every exception text the kernel stores (``error_message``, ledger and
  journal messages) or logs goes through ``scrub_error()``: credentials in URLs
  and ``key=value`` pairs are removed and the text is truncated.

Which keys are sensitive, the hook for more, and the truncation length are
settings (``store.py``). The hook is called last and may redact anything.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

from django.utils.module_loading import import_string

from . import settings, validation

REDACTED = "[redacted]"
CARD_REDACTED = "[redacted card number]"

# 13 to 19 digits, optionally grouped by single spaces or dashes: the shape of
# a primary account number. Luhn-checked before it is redacted, so order ids
# and timestamps stay readable.
_PAN_RE = re.compile(r"(?<![\w.])(?:\d[ -]?){12,18}\d(?![\w.])")
_URL_CREDENTIALS_RE = re.compile(
    r"(?<![a-zA-Z0-9+.-])(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s:@]+:[^/\s@]*@"
)
_BEARER_RE = re.compile(r"\b(?P<kind>Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{6,}", re.IGNORECASE)
# Credentials recognisable by their shape alone, with no key name before them
# (#35): Stripe's secret and restricted keys, AWS access key ids, and a
# 40-character AWS secret access key (mixed case: a lowercase hex digest is not one).
_SHAPED_SECRET_RE = re.compile(
    r"(?<![A-Za-z0-9])(?:(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{10,}|(?:AKIA|ASIA)[A-Z0-9]{16})"
    r"(?![A-Za-z0-9])"
    r"|(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+]*[a-z])(?=[A-Za-z0-9/+]*[A-Z])"
    r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"
)


def _normalize(key: str) -> str:
    return re.sub(r"[\s_\-.]", "", key.lower())


def _luhn_ok(digits: str) -> bool:
    total = 0
    for index, char in enumerate(reversed(digits)):
        value = int(char)
        if index % 2:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def looks_like_card_number(text: str) -> bool:
    digits = re.sub(r"[ -]", "", text)
    return 13 <= len(digits) <= 19 and digits.isdigit() and _luhn_ok(digits)


def _key_rules() -> tuple[frozenset[str], tuple[str, ...]]:
    """The configured keys, normalized once per value redacted (not once per key)."""
    exact = frozenset(_normalize(k) for k in settings.redact_exact_keys() if k)
    parts = tuple(p for p in (_normalize(k) for k in settings.redact_keys()) if p)
    return exact, parts


def is_sensitive_key(key: Any, rules: tuple[frozenset[str], tuple[str, ...]] | None = None) -> bool:
    """A key whose value is never shown: a configured substring of it, or an exact match."""
    if not isinstance(key, str):
        return False
    normalized = _normalize(key)
    if not normalized:
        return False
    exact, parts = rules or _key_rules()
    return normalized in exact or any(part in normalized for part in parts)


# ``key=value``, ``key: value`` and ``"key": "value"``. A key starts only where
# a word starts (the lookbehind), so a long run of letters is scanned once, not
# once per position: the texts are exception messages and inputs of any size.
# A value is never itself a ``key=``: in ``ValueError: password=x`` (an exception
# as tracebacks print it) the pair is ``password=x``, not ``ValueError: ...``.
_PAIR_RE = re.compile(
    r"(?<![\w-])(?P<key>[\w-]+)(?P<sep>[\"']?\s*[=:]\s*)"
    r"(?P<value>\"[^\"]*\"|'[^']*'|(?![\w-]+[\"']?\s*[=:])[^\s&;,\"'#)}\]]+)"
)


# A URL's query parameters: ``?api_key=...&token=...``. Matched on their own, first:
# the ``key=value`` pattern reads ``https://host/path?api_key=x`` as one pair whose
# key is ``https``, and the credential after the ``?`` survived in error texts.
_QUERY_RE = re.compile(r"(?P<lead>[?&;])(?P<key>[^=&#;\s?]+)=(?P<value>[^&#;\s]*)")


def _redact_query(match: re.Match[str], rules: tuple[frozenset[str], tuple[str, ...]]) -> str:
    if not match.group("value") or not is_sensitive_key(match.group("key"), rules):
        return match.group(0)
    return f"{match.group('lead')}{match.group('key')}={REDACTED}"


def _redact_cards(text: str) -> str:
    return _PAN_RE.sub(
        lambda m: CARD_REDACTED if looks_like_card_number(m.group(0)) else m.group(0), text
    )


def _redact_pair(match: re.Match[str], rules: tuple[frozenset[str], tuple[str, ...]]) -> str:
    if not is_sensitive_key(match.group("key"), rules):
        return match.group(0)
    value = match.group("value")
    if value.startswith(REDACTED[:-1]):  # a query parameter redacted already
        return match.group(0)
    quote = value[0] if value[0] in "\"'" else ""
    return f"{match.group('key')}{match.group('sep')}{quote}{REDACTED}{quote}"


def redact_text(text: Any) -> Any:
    """A text without credentials in URLs, secret ``key=value`` pairs, tokens or card numbers."""
    if not isinstance(text, str) or not text:
        return text
    text = _URL_CREDENTIALS_RE.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    text = _BEARER_RE.sub(lambda m: f"{m.group('kind')} {REDACTED}", text)
    text = _SHAPED_SECRET_RE.sub(REDACTED, text)
    rules = _key_rules()
    text = _QUERY_RE.sub(lambda m: _redact_query(m, rules), text)
    text = _PAIR_RE.sub(lambda m: _redact_pair(m, rules), text)
    return _redact_cards(text)


def _redact_value(value: Any, rules: tuple[frozenset[str], tuple[str, ...]]) -> Any:
    if isinstance(value, dict):
        return {
            key: REDACTED if is_sensitive_key(key, rules) else _redact_value(item, rules)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_redact_value(item, rules) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and looks_like_card_number(str(value))
    ):
        return CARD_REDACTED
    return value


def _hook() -> Callable[[Any], Any] | None:
    path = settings.redact_hook()
    if not path:
        return None
    return import_string(path) if isinstance(path, str) else path


def redact(value: Any) -> Any:
    """A copy of a JSON value fit to show: sensitive keys and card numbers redacted.

    The configured hook (``REDACT_HOOK``) receives the result and returns
    what is shown; it can redact more, never less than the defaults.
    """
    redacted = _redact_value(value, _key_rules())
    hook = _hook()
    return hook(redacted) if hook is not None else redacted


def shorten(value: Any, max_chars: int, max_items: int = 100) -> Any:
    """A copy of a JSON value cut for display (long strings, long lists and objects).

    Applied before redaction: a 10 MB value cannot be shown and would take
    seconds to scan. A string is cut on a space near the limit when there is
    one, so a URL or a ``key=value`` at the edge is dropped whole rather than
    shown in part. What is cut is said, never silently dropped.
    """
    if isinstance(value, dict):
        items = list(value.items())
        shown = {key: shorten(item, max_chars, max_items) for key, item in items[:max_items]}
        if len(items) > max_items:
            shown["…"] = f"{len(items) - max_items} more keys not shown"
        return shown
    if isinstance(value, list | tuple):
        shown_list = [shorten(item, max_chars, max_items) for item in value[:max_items]]
        if len(value) > max_items:
            shown_list.append(f"… {len(value) - max_items} more items not shown")
        return shown_list
    if isinstance(value, str) and len(value) > max_chars:
        head = value[:max_chars]
        space = head.rfind(" ", max_chars - 200)
        if space > 0:
            head = head[:space]
        return f"{head}… [{len(value) - len(head)} more characters]"
    return value


def truncate(text: str, limit: int | None = None) -> str:
    limit = settings.error_text_max_chars() if limit is None else limit
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    return f"{text[:limit]}… [{cut} more characters truncated]"


def scrub_error(text: Any) -> str:
    """An exception text fit to store or log: credentials removed, then truncated.

    Redacted before truncation, so a cut never leaves half a secret visible.
    NUL characters are escaped last: PostgreSQL refuses them in ``text``, and a
    failure whose text cannot be written would look like a crashed worker.
    """
    if text is None:
        return ""
    if isinstance(text, BaseException):
        text = f"{type(text).__name__}: {text}"
    return validation.storable_message(truncate(redact_text(str(text))))


class ScrubFilter(logging.Filter):
    """A logging filter that scrubs the message and the traceback of each record.

    Applied to every record of the package's loggers as it is made
    (``install_log_filter``): a traceback's last line repeats the exception
    text, which may hold the very URL its message was scrubbed of.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logging's problem, not ours
            return True
        record.msg = scrub_error(message)
        record.args = ()
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


#: Loggers of the package whose records are left as they are: the per-step events
#: carry texts scrubbed before they were stored, and a witness record is compared
#: byte for byte with the database by ``verifyworkflows --witness``.
UNSCRUBBED_LOGGERS = frozenset({"k2b_workflows.events", "k2b_workflows.witness"})

_installed = False
_install_lock = threading.Lock()


#: django.tasks' loggers (Django's, the backport's): they log each task's end, a
#: failed one with its exception and traceback, which may hold what its error was
#: scrubbed of where it was stored.
TASK_LOGGERS = ("django.tasks", "django_tasks")


def _ours(name: str) -> bool:
    if any(name == root or name.startswith(f"{root}.") for root in TASK_LOGGERS):
        return True
    return (name == "k2b_workflows" or name.startswith("k2b_workflows.")) and (
        name not in UNSCRUBBED_LOGGERS
    )


def install_log_filter() -> None:
    """Scrub what the package's loggers log, whichever module's logger made the record.

    Every module logs on a logger of its own (``k2b_workflows.<module>``). A
    filter added to the ``k2b_workflows`` logger would not see their records:
    logging consults a logger's filters only for records logged on it, not for
    those its children pass up. So the scrub runs where a record is made, in
    the record factory (the previous factory is kept and called first).
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        previous = logging.getLogRecordFactory()
        scrub = ScrubFilter()

        def make_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            if _ours(record.name):
                scrub.filter(record)
            return record

        logging.setLogRecordFactory(make_record)
        _installed = True
