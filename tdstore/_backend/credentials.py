"""Credentials of a connection: what a pickle may carry, where a reconnecting process finds them.

A pickled store handle carries its connection settings, but by default **no secret**: the
``password`` and ``ssl_password`` arguments are left out, and so is a credential provider that
holds a password in clear (redis-py's ``UsernamePasswordCredentialProvider``, whose username is
kept) or that cannot be pickled. The process that unpickles the handle gets them from

1. a picklable ``credential_provider=`` given when the store was created (it travels with the
   pickle and fetches the secret where it runs: a vault, a file, the environment), or
2. the environment: ``TDSTORE_PASSWORD`` (and ``TDSTORE_USERNAME``, ``TDSTORE_SSL_PASSWORD``),
   or the password in ``TDSTORE_URL`` (``redis://user:password@host:port/db``) when that URL
   names the same server.

``pickle_secrets=True`` (a store argument) keeps the old behaviour: the password travels in the
pickle, in clear. The same environment variables fill in the credentials of a store created
without ``password=`` or ``credential_provider=``.
"""

from __future__ import annotations

import os
import pickle
from typing import Any
from urllib.parse import ParseResult, parse_qs, unquote, urlparse

from redis.credentials import UsernamePasswordCredentialProvider

__all__ = ["SECRET_KWARGS", "strip_secrets", "fill_from_env", "tls_from_url", "who", "missing_hint", "login_kwargs"]

#: Client arguments that are secrets: never pickled unless the store opted in.
SECRET_KWARGS: tuple[str, ...] = ("password", "ssl_password")

ENV_PASSWORD = "TDSTORE_PASSWORD"
ENV_USERNAME = "TDSTORE_USERNAME"
ENV_SSL_PASSWORD = "TDSTORE_SSL_PASSWORD"


def strip_secrets(kwargs: dict[str, object]) -> list[str]:
    """Removes the secrets from client ``kwargs`` (in place); returns the names removed."""
    dropped = [name for name in SECRET_KWARGS if kwargs.pop(name, None) is not None]
    provider = kwargs.get("credential_provider")
    if provider is None:
        return dropped
    if isinstance(provider, UsernamePasswordCredentialProvider):
        # it holds the password in clear: keep only the user name
        del kwargs["credential_provider"]
        if provider.username:
            kwargs["username"] = provider.username
        dropped.append("password")
        return dropped
    try:
        pickle.dumps(provider)
    except Exception:  # noqa: BLE001 - any failure means it cannot travel
        del kwargs["credential_provider"]
        dropped.append("credential_provider")
    return dropped


#: Certificate settings a ``rediss://`` TDSTORE_URL may carry as query arguments (paths, no secrets).
_URL_TLS_ARGS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")


def _env_url(kwargs: dict[str, Any]) -> ParseResult | None:
    """``TDSTORE_URL`` parsed, when it names the server of ``kwargs``; else ``None``."""
    url = os.environ.get("TDSTORE_URL")
    if not url:
        return None
    parsed = urlparse(url)
    if parsed.scheme.lower() == "redis+sentinel":
        return None  # several hosts: its credentials are applied with it (tdstore/_backend/sentinel.py)
    if parsed.scheme == "unix":
        same = kwargs.get("path") == parsed.path
    else:
        same = kwargs.get("host") == parsed.hostname and int(kwargs.get("port") or 0) == (parsed.port or 6379)
    return parsed if same else None


def tls_from_url(kwargs: dict[str, object]) -> bool:
    """Whether ``TDSTORE_URL`` is a ``rediss://`` URL naming this server; fills its ``ssl_*`` arguments.

    ``TDSTORE_URL=rediss://host:6380/0?ssl_ca_certs=/etc/tds/ca.pem`` makes stores created with
    default connection arguments use TLS, verified against that CA.
    """
    parsed = _env_url(kwargs)
    if parsed is None or parsed.scheme != "rediss":
        return False
    for name, values in parse_qs(parsed.query).items():
        if name in _URL_TLS_ARGS and values:
            kwargs.setdefault(name, values[-1])
    return True


def _url_credentials(kwargs: dict[str, object]) -> tuple[str | None, str | None]:
    """User and password of ``TDSTORE_URL`` when it names the server of ``kwargs``."""
    parsed = _env_url(kwargs)
    if parsed is None or (parsed.password is None and parsed.username is None):
        return None, None
    user = unquote(parsed.username) if parsed.username else None
    password = unquote(parsed.password) if parsed.password else None
    return user, password


def fill_from_env(kwargs: dict[str, object]) -> str | None:
    """Fills missing credentials of client ``kwargs`` from the environment (in place).

    Returns where they came from (for error messages), or ``None`` when nothing was found.
    A credential provider, when present, is left to do its job.
    """
    if kwargs.get("credential_provider") is not None:
        return None
    source = None
    url_user, url_password = _url_credentials(kwargs)
    password = os.environ.get(ENV_PASSWORD)
    if kwargs.get("password") is None:
        if password:
            kwargs["password"] = password
            source = ENV_PASSWORD
        elif url_password:
            kwargs["password"] = url_password
            source = "TDSTORE_URL"
    if source is not None and kwargs.get("username") is None:
        # only beside a password taken from the same place: a password given in code is
        # the default user's unless the code names a user too
        user = os.environ.get(ENV_USERNAME) if source == ENV_PASSWORD else url_user
        if user:
            kwargs["username"] = user
    ssl_password = os.environ.get(ENV_SSL_PASSWORD)
    if ssl_password and kwargs.get("ssl_password") is None and kwargs.get("ssl_keyfile"):
        kwargs["ssl_password"] = ssl_password
    return source


def who(kwargs: dict[str, object]) -> str:
    """The user a connection authenticates as, for messages (never the password)."""
    if kwargs.get("credential_provider") is not None:
        return f"the user given by credential_provider {type(kwargs['credential_provider']).__name__}"
    if kwargs.get("username"):
        return f"user {kwargs['username']!r}"
    return "the default user"


def missing_hint(dropped: list[str]) -> str:
    """How to give a reconnecting process the credentials its pickle did not carry."""
    if not dropped:
        return (
            "Pass password= (and username=) or credential_provider= to the store, or set "
            f"{ENV_PASSWORD} (and {ENV_USERNAME}) in the environment."
        )
    return (
        f"This store handle was unpickled without its {' and '.join(sorted(set(dropped)))} (pickled stores "
        f"carry no secrets by default). Set {ENV_PASSWORD} (and {ENV_USERNAME}) in this process's "
        "environment, create the store with a picklable credential_provider= (a "
        "redis.credentials.CredentialProvider that fetches the secret where it runs), or create it "
        "with pickle_secrets=True to carry the password in the pickle, in clear."
    )


def login_kwargs(username: str | None, password: str | None) -> dict[str, Any]:
    """The ``username=`` and ``password=`` client arguments of a login, those that are set."""
    return {name: value for name, value in (("username", username), ("password", password)) if value is not None}
