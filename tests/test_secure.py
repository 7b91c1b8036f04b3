"""Secured connections: TLS, ACL users with passwords, unix sockets, and secrets in pickles.

``TestConformance`` is a representative slice of the conformance suite (create, read, write,
indexed read/write, update, from_store, pickle, extend, clear) run over every secured transport
of ``secure_server`` (``redis-tls``, ``redis-acl``, ``valkey-acl``, ``redis-unix``). The other
tests check the failure modes: a wrong password or a missing one, a client that does not trust
the server's CA, and what a pickled store carries.
"""

from __future__ import annotations

import pickle

import pytest
import redis
import torch
from conftest import ACL_ADMIN_PASSWORD, ACL_PASSWORD, ACL_USER, admin_handle
from redis.credentials import CredentialProvider, UsernamePasswordCredentialProvider
from tensordict import NonTensorData, TensorDict

import tdstore
from tdstore import TensorDictStore
from tdstore.server import start_server


@pytest.fixture
def no_env_credentials(monkeypatch):
    for name in ("TDSTORE_PASSWORD", "TDSTORE_USERNAME", "TDSTORE_SSL_PASSWORD", "TDSTORE_URL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _expect_transport(store: TensorDictStore, handle) -> None:
    """The store really uses the transport and the user of the fixture."""
    conn = store._conn
    kwargs = conn._conn_kwargs
    if handle.port is None:
        assert kwargs["path"] == handle.unix_socket_path and conn.describe().startswith("unix://")
    else:
        assert kwargs["port"] == handle.port
    expected_class = redis.asyncio.SSLConnection if handle._tls is not None and handle.port else None
    assert expected_class is None or conn._connection_class is expected_class
    assert kwargs.get("username") == handle._username


def _snapshot_td() -> TensorDict:
    g = torch.Generator().manual_seed(7)
    return TensorDict(
        {
            "obs": torch.randn(8, 3, generator=g),
            "act": torch.randint(0, 5, (8,), generator=g),
            "nested": TensorDict({"x": torch.randn(8, 2, generator=g)}, [8]),
        },
        [8],
    )


class TestConformance:
    """One pass over the main features, per secured transport."""

    def test_create_read_write(self, stores, secure_server, wire):
        td = _snapshot_td()
        store = stores(secure_server, "from_tensordict", td)
        _expect_transport(store, secure_server)
        assert (store.to_tensordict() == td).all()
        store["label"] = NonTensorData("hello")
        store["obs"] = torch.zeros(8, 3)
        assert torch.equal(store["obs"], torch.zeros(8, 3)) and store["label"] == "hello"
        keys = {k.decode() for k in wire(secure_server)}
        assert any(k.endswith(":reg") and store.td_id in k for k in keys)
        assert all(store.td_id in k for k in keys)

    def test_indexed_read_and_write(self, stores, secure_server):
        td = _snapshot_td()
        store = stores(secure_server, "from_tensordict", td)
        idx = torch.tensor([6, 1, 3])
        assert (store[idx].to_tensordict() == td[idx]).all()
        rows = TensorDict({"obs": torch.ones(3, 3), "act": torch.full((3,), 4), "nested": {"x": torch.ones(3, 2)}}, [3])
        store[idx] = rows
        td[idx] = rows
        assert (store.to_tensordict() == td).all()
        store[2:8:3] = rows[:2]
        td[2:8:3] = rows[:2]
        assert (store[1:7].to_tensordict() == td[1:7]).all()

    def test_update_and_from_store(self, stores, secure_server):
        store = stores(secure_server, batch_size=[4])
        store.update({"a": torch.arange(4), "n": {"b": torch.ones(4, 2)}})
        other = stores(secure_server, "from_store", td_id=store.td_id)
        _expect_transport(other, secure_server)
        assert torch.equal(other["a"], torch.arange(4)) and torch.equal(other["n", "b"], torch.ones(4, 2))
        other["a"] += 10
        assert torch.equal(store["a"], torch.arange(4) + 10)

    def test_pickle_round_trip(self, stores, secure_server, no_env_credentials):
        store = stores(secure_server, batch_size=[4])
        store["a"] = torch.arange(4.0)
        blob = pickle.dumps(store)
        if secure_server._password is not None:
            assert secure_server._password.encode() not in blob
            no_env_credentials.setenv("TDSTORE_PASSWORD", secure_server._password)
        again = pickle.loads(blob)
        try:
            assert torch.equal(again["a"], torch.arange(4.0))
            again["b"] = torch.ones(4)
            assert torch.equal(store["b"], torch.ones(4))
        finally:
            again.close()

    def test_ring_buffer_extend(self, stores, secure_server):
        buf = stores(secure_server, "from_schema", {"obs": ([2], torch.float32)}, batch_size=[5])
        buf.extend(TensorDict(obs=torch.ones(3, 2), batch_size=[3]))
        buf.extend(TensorDict(obs=torch.full((4, 2), 2.0), batch_size=[4]))
        assert buf["obs"][:, 0].tolist() == [2.0, 2.0, 1.0, 2.0, 2.0]

    def test_clear_redis_leaves_nothing(self, stores, secure_server, wire):
        before = wire(secure_server)
        store = stores(secure_server, "from_tensordict", _snapshot_td())
        assert wire(secure_server) != before
        store.clear_redis()
        assert wire(secure_server) == before


# ---------------------------------------------------------------------------------- ACL


def test_wrong_password_names_server_and_user_not_password(acl_server, wire):
    before = wire(acl_server)
    bad = "not-the-password-5e1"
    kwargs = {**acl_server.connection_kwargs(), "password": bad}
    with pytest.raises(tdstore.ServerAuthError) as info:
        TensorDictStore(batch_size=[2], **kwargs)
    text = str(info.value)
    assert isinstance(info.value, redis.exceptions.AuthenticationError)
    assert f"{acl_server.host}:{acl_server.port}" in text
    assert f"user {ACL_USER!r}" in text
    assert bad not in text and ACL_PASSWORD not in text
    assert "refused the credentials" in text
    assert wire(acl_server) == before


def test_unknown_user(acl_server):
    kwargs = {**acl_server.connection_kwargs(), "username": "nobody"}
    with pytest.raises(tdstore.ServerAuthError, match="user 'nobody'") as info:
        TensorDictStore(batch_size=[2], **kwargs)
    assert ACL_PASSWORD not in str(info.value)


def test_missing_password_says_how_to_give_one(acl_server, no_env_credentials):
    kwargs = acl_server.connection_kwargs()
    kwargs.pop("username"), kwargs.pop("password")
    with pytest.raises(tdstore.ServerAuthError) as info:
        TensorDictStore(batch_size=[2], **kwargs)
    text = str(info.value)
    assert "no password was given" in text and "TDSTORE_PASSWORD" in text and "password=" in text


def test_password_from_the_environment(acl_server, no_env_credentials, stores):
    kwargs = acl_server.connection_kwargs()
    kwargs.pop("password")
    no_env_credentials.setenv("TDSTORE_PASSWORD", ACL_PASSWORD)
    store = stores(acl_server, conn={"password": None}, batch_size=[2])
    store["a"] = torch.ones(2)
    assert store._conn._credentials_from == "TDSTORE_PASSWORD"
    # the URL's credentials apply to the server the URL names
    no_env_credentials.delenv("TDSTORE_PASSWORD")
    no_env_credentials.setenv(
        "TDSTORE_URL", f"redis://{ACL_USER}:{ACL_PASSWORD}@{acl_server.host}:{acl_server.port}/0"
    )
    again = TensorDictStore.from_store(td_id=store.td_id)  # default host/port: TDSTORE_URL
    try:
        assert torch.equal(again["a"], torch.ones(2)) and again._conn._credentials_from == "TDSTORE_URL"
    finally:
        again.close()


def test_pickle_carries_no_secret_by_default(stores, acl_server, no_env_credentials):
    store = stores(acl_server, batch_size=[2])
    store["a"] = torch.arange(2)
    blob = pickle.dumps(store)
    assert ACL_PASSWORD.encode() not in blob and ACL_USER.encode() in blob
    store["n", "b"] = torch.ones(2)
    assert ACL_PASSWORD.encode() not in pickle.dumps(store["n"])  # a nested handle too
    restored = pickle.loads(blob)
    with pytest.raises(tdstore.ServerAuthError) as info:
        restored["a"]
    text = str(info.value)
    assert "unpickled without its password" in text
    for hint in ("TDSTORE_PASSWORD", "credential_provider=", "pickle_secrets=True"):
        assert hint in text, text
    assert f"user {ACL_USER!r}" in text and ACL_PASSWORD not in text
    restored.close()
    no_env_credentials.setenv("TDSTORE_PASSWORD", ACL_PASSWORD)
    restored = pickle.loads(blob)
    assert torch.equal(restored["a"], torch.arange(2))
    restored.close()


def test_pickle_secrets_opt_in(stores, acl_server, no_env_credentials):
    store = stores(acl_server, batch_size=[2], pickle_secrets=True)
    store["a"] = torch.arange(2)
    blob = pickle.dumps(store)
    assert ACL_PASSWORD.encode() in blob
    restored = pickle.loads(blob)
    assert torch.equal(restored["a"], torch.arange(2))
    again = pickle.loads(pickle.dumps(restored))  # the opt-in travels on
    assert torch.equal(again["a"], torch.arange(2))
    restored.close(), again.close()


class FileCredentials(CredentialProvider):
    """Reads the password where the process runs (a picklable provider holds no secret)."""

    def __init__(self, username: str, path: str) -> None:
        self.username = username
        self.path = path

    def get_credentials(self):
        with open(self.path) as fh:
            return self.username, fh.read().strip()


def test_picklable_credential_provider_travels(stores, acl_server, tmp_path, no_env_credentials):
    secret = tmp_path / "pw"
    secret.write_text(ACL_PASSWORD)
    conn = {"username": None, "password": None, "credential_provider": FileCredentials(ACL_USER, str(secret))}
    kwargs = {**acl_server.connection_kwargs(), **conn}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    store = TensorDictStore(batch_size=[2], **kwargs)
    try:
        store["a"] = torch.arange(2)
        blob = pickle.dumps(store)
        assert ACL_PASSWORD.encode() not in blob
        restored = pickle.loads(blob)
        assert torch.equal(restored["a"], torch.arange(2))
        restored.close()
    finally:
        store.close()


def test_username_password_provider_is_stripped(acl_server, no_env_credentials):
    kwargs = {k: v for k, v in acl_server.connection_kwargs().items() if k not in ("username", "password")}
    store = TensorDictStore(
        batch_size=[2], credential_provider=UsernamePasswordCredentialProvider(ACL_USER, ACL_PASSWORD), **kwargs
    )
    try:
        store["a"] = torch.arange(2)
        blob = pickle.dumps(store)
        assert ACL_PASSWORD.encode() not in blob
        no_env_credentials.setenv("TDSTORE_PASSWORD", ACL_PASSWORD)
        restored = pickle.loads(blob)
        assert restored._conn._conn_kwargs["username"] == ACL_USER
        assert torch.equal(restored["a"], torch.arange(2))
        restored.close()
    finally:
        store.close()


def test_user_limited_to_a_prefix(acl_server, no_env_credentials):
    """A job's user sees only its prefix: its stores work, another prefix is refused by the server."""
    admin = admin_handle(acl_server).sync_client()
    admin.acl_setuser(
        "job1", enabled=True, passwords=["+job1-pass"], keys=["job1:*"], commands=["+@all", "-@dangerous"]
    )
    base = {k: v for k, v in acl_server.connection_kwargs().items() if k not in ("username", "password")}
    store = TensorDictStore(prefix="job1", batch_size=[2], username="job1", password="job1-pass", **base)
    try:
        store["a"] = torch.arange(2)
        assert torch.equal(store["a"], torch.arange(2))
        with pytest.raises(tdstore.ServerPermissionError) as info:
            TensorDictStore(prefix="job2", batch_size=[2], username="job1", password="job1-pass", **base)
        text = str(info.value)
        assert isinstance(info.value, redis.exceptions.NoPermissionError)
        assert "user 'job1'" in text and "~job2:*" in text and "no permissions" in text
        assert "job1-pass" not in text
        with pytest.raises(tdstore.ServerPermissionError, match="prefix='job2'"):
            TensorDictStore.from_store(td_id=store.td_id, prefix="job2", username="job1", password="job1-pass", **base)
    finally:
        store.clear_redis()
        store.close()
        admin.acl_deluser("job1")
        admin.close()


def test_admin_password_is_not_the_users(acl_server):
    assert acl_server._password == ACL_PASSWORD and admin_handle(acl_server)._password == ACL_ADMIN_PASSWORD


# ---------------------------------------------------------------------------------- TLS


def test_tls_server_refuses_plain_clients(tls_server):
    kwargs = {k: v for k, v in tls_server.connection_kwargs().items() if not k.startswith("ssl")}
    with pytest.raises(redis.exceptions.ConnectionError):
        TensorDictStore(batch_size=[2], timeout=5, **kwargs)


def test_tls_wrong_ca_fails_clearly(tls_server, tls_files, wire):
    before = wire(tls_server)
    kwargs = {**tls_server.connection_kwargs(), "ssl_ca_certs": tls_files.other_ca_file}
    with pytest.raises(tdstore.ServerTLSError) as info:
        TensorDictStore(batch_size=[2], **kwargs)
    text = str(info.value)
    assert isinstance(info.value, redis.exceptions.ConnectionError)
    assert f"{tls_server.host}:{tls_server.port}" in text
    assert "CERTIFICATE_VERIFY_FAILED" in text and tls_files.other_ca_file in text
    assert wire(tls_server) == before


def test_tls_pickle_keeps_the_ca(stores, tls_server):
    store = stores(tls_server, batch_size=[2])
    store["a"] = torch.arange(2)
    restored = pickle.loads(pickle.dumps(store))
    try:
        assert restored._conn._conn_kwargs["ssl_ca_certs"] == tls_server._tls["ssl_ca_certs"]
        assert torch.equal(restored["a"], torch.arange(2))
    finally:
        restored.close()


def test_tls_with_client_certificates_and_acl(tls_files, tmp_path):
    """Mutual TLS (the server requires a client certificate) plus an ACL user, together."""
    import trustme

    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("tds-client")
    paths = {name: str(tmp_path / f"{name}.pem") for name in ("ca", "cert", "key", "ccert", "ckey")}
    ca.cert_pem.write_to_path(paths["ca"])
    server_cert.cert_chain_pems[0].write_to_path(paths["cert"])
    server_cert.private_key_pem.write_to_path(paths["key"])
    client_cert.cert_chain_pems[0].write_to_path(paths["ccert"])
    client_cert.private_key_pem.write_to_path(paths["ckey"])
    files = tdstore.server.TLSFiles(paths["cert"], paths["key"], paths["ca"], paths["ccert"], paths["ckey"])
    with start_server("redis", tls=files, acl_users={"mtls": "mtls-pass"}) as handle:
        user = handle.as_user("mtls", "mtls-pass")
        store = TensorDictStore(batch_size=[2], **user.connection_kwargs())
        store["a"] = torch.arange(2)
        assert torch.equal(store["a"], torch.arange(2))
        store.clear_redis()
        store.close()
        no_cert = {k: v for k, v in user.connection_kwargs().items() if k not in ("ssl_certfile", "ssl_keyfile")}
        with pytest.raises(redis.exceptions.ConnectionError):
            TensorDictStore(batch_size=[2], timeout=5, **no_cert)


def test_rediss_url_from_the_environment(tls_server, tls_files, no_env_credentials):
    """TDSTORE_URL=rediss://...?ssl_ca_certs=... points default-argument stores at a TLS server."""
    url = f"rediss://{tls_server.host}:{tls_server.port}/0?ssl_ca_certs={tls_files.server.ca_file}"
    no_env_credentials.setenv("TDSTORE_URL", url)
    store = TensorDictStore(batch_size=[2])
    try:
        assert store._conn._connection_class is redis.asyncio.SSLConnection
        store["a"] = torch.arange(2)
        worker = pickle.loads(pickle.dumps(store))
        assert torch.equal(worker["a"], torch.arange(2))
        worker.close()
        store.clear_redis()
    finally:
        store.close()
    no_env_credentials.setenv("TDSTORE_URL", f"rediss://{tls_server.host}:{tls_server.port}/0?ssl_ca_certs={tls_files.other_ca_file}")
    with pytest.raises(tdstore.ServerTLSError, match="CERTIFICATE_VERIFY_FAILED"):
        TensorDictStore(batch_size=[2])


# ---------------------------------------------------------------------------------- pieces


def test_strip_secrets_and_fill_from_env(no_env_credentials):
    from tdstore._backend import credentials as _credentials

    kwargs = {"host": "h", "port": 1, "password": "p", "ssl_password": "k", "username": "u"}
    assert sorted(_credentials.strip_secrets(kwargs)) == ["password", "ssl_password"]
    assert kwargs == {"host": "h", "port": 1, "username": "u"}
    provider = {"credential_provider": UsernamePasswordCredentialProvider("u2", "p2"), "host": "h"}
    assert _credentials.strip_secrets(provider) == ["password"] and provider == {"host": "h", "username": "u2"}
    unpicklable = {"credential_provider": FileCredentials("u", "/nowhere")}
    unpicklable["credential_provider"].lock = __import__("threading").Lock()
    assert _credentials.strip_secrets(unpicklable) == ["credential_provider"] and unpicklable == {}
    # the environment fills only what is missing, and a user only beside an env password
    assert _credentials.fill_from_env(kwargs) is None and "password" not in kwargs
    no_env_credentials.setenv("TDSTORE_USERNAME", "env-user")
    given = {"host": "h", "port": 1, "password": "code"}
    assert _credentials.fill_from_env(given) is None and given == {"host": "h", "port": 1, "password": "code"}
    no_env_credentials.setenv("TDSTORE_PASSWORD", "env-pass")
    fresh = {"host": "h", "port": 1}
    assert _credentials.fill_from_env(fresh) == "TDSTORE_PASSWORD"
    assert fresh == {"host": "h", "port": 1, "password": "env-pass", "username": "env-user"}
    kept = {"host": "h", "port": 1, "username": "u"}
    _credentials.fill_from_env(kept)
    assert kept["username"] == "u" and kept["password"] == "env-pass"
    # a URL's credentials apply to the server it names only
    no_env_credentials.delenv("TDSTORE_PASSWORD")
    no_env_credentials.setenv("TDSTORE_URL", "redis://url-user:url%40pass@h:1/0")
    other = {"host": "h", "port": 2}
    assert _credentials.fill_from_env(other) is None and "password" not in other
    same = {"host": "h", "port": 1}
    assert _credentials.fill_from_env(same) == "TDSTORE_URL"
    assert same["password"] == "url@pass" and same["username"] == "url-user"
    assert not _credentials.tls_from_url(same)
    no_env_credentials.setenv("TDSTORE_URL", "rediss://h:1/0?ssl_ca_certs=/ca.pem&ssl_password=no")
    tls = {"host": "h", "port": 1}
    assert _credentials.tls_from_url(tls) and tls == {"host": "h", "port": 1, "ssl_ca_certs": "/ca.pem"}


def test_start_server_refuses_tls_without_socket_and_on_fakeredis(tls_files):
    with pytest.raises(ValueError, match="unix_socket=True"):
        start_server("redis", tls=tls_files.server, unix_socket=False)
    with pytest.raises(ValueError, match="fakeredis"):
        start_server("fakeredis", acl_users={"u": "p"})


def test_tls_server_restarts_in_place(tls_files):
    with start_server("redis", tls=tls_files.server, acl_users={"u": "pw"}) as handle:
        assert handle.url.startswith("rediss://")
        user = handle.as_user("u", "pw")
        client = redis.Redis(**user.connection_kwargs())
        client.set("k", b"v")
        handle.restart()
        assert client.get("k") is None  # a fresh server (no persistence), same port and certificates
        assert client.acl_whoami() in ("u", b"u")
        client.close()
        assert not user.owned and user.stop() is None and handle.running  # a view stops nothing
