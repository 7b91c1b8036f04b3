"""The one error table (tdstore/_backend/translate.py), walked row by row.

Each row of ``RULES`` carries an example of the server error it matches: the example must be
matched by that row first (no row above it shadows it), and ``translate`` must turn it into the
exception the row documents, on a store connected to a real server (its messages name the
store and read the server's maxmemory). Each row of ``RETRY_RULES`` likewise gives its retry
class. Where no store is at hand (a script reply read deep in an operation), only the script
rows apply.
"""

from __future__ import annotations

import pytest
import redis.exceptions
import torch

import tdstore
from tdstore import TensorDictStore
from tdstore._backend import retry as _retry
from tdstore._backend.translate import RETRY_RULES, RULES, retry_class, rule_for, translate
from tdstore.errors import LUA_ERRORS, TDStoreError


def _example(rule) -> BaseException:
    return rule.error[0](rule.example)


@pytest.fixture
def store(server):
    store = TensorDictStore(batch_size=[2], prefix="tr", **server.connection_kwargs())
    yield store
    store.clear_redis()
    store.close()


@pytest.fixture
def full_store(real_server):
    """A store on a server that says it is at its maxmemory (a limit of 1 byte) while the test reads it."""
    store = TensorDictStore(batch_size=[2], prefix="tr", **real_server.connection_kwargs())
    client = real_server.sync_client()
    old = client.config_get("maxmemory")["maxmemory"]
    client.config_set("maxmemory", 1)
    try:
        yield store
    finally:
        client.config_set("maxmemory", old)
        store.clear_redis()
        store.close()


def test_every_rule_matches_its_example_first():
    for rule in RULES:
        err = _example(rule)
        assert rule.matches(err), rule.name
        first = next(r for r in RULES if r.stage == rule.stage and r.matches(err))
        assert first is rule, f"{rule.name}: shadowed by {first.name}"
        assert rule.raises is None or issubclass(rule.raises, (TDStoreError, TimeoutError)), rule.name


@pytest.mark.parametrize("rule", [r for r in RULES if r.when is None], ids=lambda r: r.name)
def test_each_rule_translates_to_the_exception_it_documents(store, rule):
    conn = store._conn
    err = _example(rule)
    got = translate(err, conn, limit=7.5, stage=rule.stage)
    if rule.raises is None:
        assert got is err
        return
    assert type(got) is rule.raises or (rule.raises is not TimeoutError and isinstance(got, rule.raises)), (rule.name, got)
    if rule.name == "credentials refused":
        assert got.__cause__ is None and got.__suppress_context__  # no frames holding the client's kwargs
    else:
        assert got.__cause__ is err
    text = str(got)
    if rule.name.startswith("script error"):
        assert text == "an example message"
    elif rule.raises is TimeoutError:
        assert "did not answer within 7.5 s" in text
    else:
        assert f"td_id={store.td_id!r}" in text  # names the store


def test_a_refused_multi_is_out_of_memory_when_the_server_is_full(full_store):
    rule = next(r for r in RULES if r.name == "MULTI refused over maxmemory")
    err = _example(rule)
    got = translate(err, full_store._conn)
    assert isinstance(got, tdstore.ServerOutOfMemoryError) and got.__cause__ is err
    assert "maxmemory 1 bytes" in str(got) and "Nothing of this operation was applied" in str(got)


def test_a_refused_multi_on_a_server_with_room_stays_as_it_is(store):
    err = redis.exceptions.ExecAbortError("EXECABORT Transaction discarded because of previous errors.")
    assert translate(err, store._conn) is err


def test_a_tls_error_outside_the_handshake_stays_as_it_is(store):
    rule = next(r for r in RULES if r.name == "TLS handshake failed")
    assert isinstance(translate(_example(rule), store._conn, stage="setup"), tdstore.ServerTLSError)
    err = _example(rule)
    assert translate(err, store._conn) is err  # later: a lost connection, retried by the policy
    plain = redis.exceptions.ConnectionError("Error 111 connecting to localhost:1. Connection refused.")
    assert translate(plain, store._conn, stage="setup") is plain  # not an SSL failure


def test_without_a_store_only_the_script_rules_apply():
    for rule in RULES:
        err = _example(rule)
        got = translate(err, stage=rule.stage)
        if rule.name.startswith("script error"):
            assert isinstance(got, rule.raises) and got.__cause__ is err
        else:
            assert got is err, rule.name


@pytest.mark.parametrize("code", sorted(LUA_ERRORS))
def test_script_codes_translate_as_redis_7_and_redis_6_send_them(code):
    plain = redis.exceptions.ResponseError(f"{code} entry ('x',) is locked")
    wrapped = redis.exceptions.ResponseError(
        f"Error running script (call to f_0123abcd): @user_script:12: {code} entry ('x',) is locked "
        "script: 0123abcd, on @user_script:12."
    )
    for err in (plain, wrapped):
        got = translate(err)
        assert type(got) is LUA_ERRORS[code] and str(got) == "entry ('x',) is locked"
    unknown = redis.exceptions.ResponseError("TDS_NOSUCHCODE what")
    assert rule_for(unknown) is None and translate(unknown) is unknown


def test_every_retry_rule_gives_its_class_first():
    for rule in RETRY_RULES:
        err = _example(rule)
        first = next(r for r in RETRY_RULES if r.matches(err))
        assert first is rule, f"{rule.name}: shadowed by {first.name}"
        assert retry_class(err) == rule.retry
        assert rule.retry in ("unsent", "unknown", None)
    assert retry_class(ValueError("x")) is None  # no row: never retried
    assert _retry.classify is retry_class  # the old name, the same table


def test_retry_classes_of_translated_errors():
    """What ``Connection.run`` classifies is what ``translate`` raised: tdstore's own errors are never retried."""
    assert retry_class(tdstore.ServerUnavailableError("gone")) is None
    assert retry_class(tdstore.ServerTLSError("[SSL] Error 1 connecting to h:1")) is None
    assert retry_class(TimeoutError("the server did not answer within 1 s")) is None
    assert retry_class(redis.exceptions.TimeoutError("Timeout connecting to server")) == "unsent"


def test_an_acl_refusal_reaches_the_caller_translated(acl_server):
    """End to end: a command the user's ACL refuses raises ServerPermissionError naming the store."""
    store = TensorDictStore(batch_size=[2], prefix="tr", **acl_server.connection_kwargs())
    store["a"] = torch.zeros(2)
    with pytest.raises(tdstore.ServerPermissionError, match=f"td_id={store.td_id!r}"):
        store._conn.run(lambda c: c.config_get("maxmemory"))  # CONFIG is @dangerous
    store.clear_redis()
    store.close()
