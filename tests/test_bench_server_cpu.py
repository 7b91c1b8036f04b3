"""``tdstore bench`` reports the server's CPU per operation beside the wall-time ratios (issue 16)."""

from __future__ import annotations

import io
import json

import pytest

from tdstore.cli import main
from tdstore.cli.bench import _server_cpu_s
from tdstore.server import ServerHandle


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    code = main(argv, out=out, stdin=io.StringIO(""))
    return code, out.getvalue()


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_bench_prints_server_cpu_per_op(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    handle: ServerHandle = request.getfixturevalue(f"{kind}_server")
    for name in ("REDISCLI_AUTH", "TDSTORE_URL", "TDSTORE_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    kwargs = handle.connection_kwargs(unix=True)
    assert "password" not in handle.connection_kwargs() and "unix_socket_path" in kwargs
    args = ["bench", "--mb", "1", "--rows", "128", "--row-bytes", "4096", "--batch", "32", "--repeat", "3",
            "-s", kwargs["unix_socket_path"]]
    code, text = _run([*args, "--json"])
    assert code == 0
    results = json.loads(text)["results"]
    assert len(results) == 5
    for r in results:
        # every case moves at least a row through the server: it costs it some CPU
        assert r["tdstore_server_us"] > 0 and r["raw_server_us"] > 0, r
        assert r["tdstore_server_us"] < 1e6 and r["raw_server_us"] < 1e6, r
    code, text = _run(args)
    assert code == 0
    lines = text.splitlines()
    assert "server us/op" in lines[0]
    assert "SERVER us/op" in lines[1] and "RAW SERVER us/op" in lines[1]
    assert len(lines) == 7


def test_server_cpu_prefers_the_main_thread_and_sums_cluster_nodes() -> None:
    one = {"used_cpu_user": 5.0, "used_cpu_sys": 3.0, "used_cpu_user_main_thread": 1.5, "used_cpu_sys_main_thread": 0.25}
    assert _server_cpu_s(one) == pytest.approx(1.75)
    assert _server_cpu_s({"used_cpu_user": 2.0, "used_cpu_sys": 0.5}) == pytest.approx(2.5)  # Redis 6: no thread fields
    assert _server_cpu_s({"a:1": one, "b:2": {"used_cpu_user": 1.0, "used_cpu_sys": 1.0}}) == pytest.approx(3.75)
