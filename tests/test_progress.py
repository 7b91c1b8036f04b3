"""Progress bars: when they show (terminal, size, switches), what they draw, and that a
transfer with a bar is still one atomic step on the server.

The module knobs (chunk sizes, the automatic mode's size and delay) are made small so the
transfers of a test are chunked and a bar shows at once; the behaviour is the same at the
real sizes.
"""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from tensordict import TensorDict

import tdstore
from tdstore import StoreExistsError, TensorDictStore
from tdstore._backend import transfer as _transfer
from tdstore._core import progress as _progress
from tdstore.testing.counts import record


class TTY(io.StringIO):
    """A captured stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def small_knobs(monkeypatch):
    monkeypatch.setattr(_transfer, "CHUNK", 64 * 1024)
    monkeypatch.setattr(_transfer, "ZERO_CHUNK", 256 * 1024)
    monkeypatch.setattr(_progress, "AUTO_MIN_BYTES", 1)
    monkeypatch.setattr(_progress, "AUTO_DELAY_S", 0.0)
    monkeypatch.setattr(_progress, "REDRAW_S", 0.0)
    monkeypatch.delenv("TDSTORE_PROGRESS", raising=False)
    yield
    tdstore.set_progress(None)


@pytest.fixture
def conn(server):
    return server.connection_kwargs()


@pytest.fixture
def client(server):
    c = server.sync_client()
    yield c
    c.close()


def sample() -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    return TensorDict(
        {
            "big": torch.randn(4, 50_000, generator=gen),  # 800 KB: several chunks (APPEND)
            "small": torch.arange(4),
            "text": "hello",
            "nest": {"x": torch.randn(4, 3, generator=gen), "empty": torch.zeros(4, 0)},
        },
        [4],
    )


def lines(text: str) -> list[str]:
    return [part for part in text.replace("\r", "\n").split("\n") if part]


# ------------------------------------------------------------------ switches
class TestSwitches:
    def test_precedence(self, monkeypatch):
        assert _progress.enabled(None, None) is None
        monkeypatch.setenv("TDSTORE_PROGRESS", "1")
        assert _progress.enabled(None) is True
        monkeypatch.setenv("TDSTORE_PROGRESS", "off")
        assert _progress.enabled(None) is False
        tdstore.set_progress(True)
        assert _progress.enabled(None) is True, "the process-wide switch wins over the environment"
        assert _progress.enabled(False) is False, "an argument wins over the switch"
        assert _progress.enabled(None, False) is False, "so does the store's setting"
        assert _progress.enabled(True, False) is True, "the call's argument wins over the store's"
        tdstore.set_progress(None)
        monkeypatch.setenv("TDSTORE_PROGRESS", "maybe")
        assert _progress.enabled(None) is None, "an unknown value leaves automatic mode"

    @pytest.mark.parametrize("bad", ["yes", 1, 0.0])
    def test_bad_values(self, bad):
        with pytest.raises(TypeError, match="set_progress expects True, False or None"):
            tdstore.set_progress(bad)
        with pytest.raises(TypeError, match="progress must be True, False or None"):
            _progress.enabled(bad)

    def test_start(self, monkeypatch):
        assert _progress.start(10, "x", None, stream=io.StringIO()) is None, "not a terminal"
        assert isinstance(_progress.start(10, "x", None, stream=TTY()), _progress.Progress)
        assert isinstance(_progress.start(10, "x", True, stream=io.StringIO()), _progress.Progress)
        assert _progress.start(10, "x", False, stream=TTY()) is None
        monkeypatch.setattr(_progress, "AUTO_MIN_BYTES", 100)
        assert _progress.start(99, "x", None, stream=TTY()) is None, "too small to need a bar"
        assert _progress.start(100, "x", None, stream=TTY()).delay == _progress.AUTO_DELAY_S


class TestBar:
    def test_draws_percent_bytes_and_ends_the_line(self):
        out = io.StringIO()
        bar = _progress.Progress(4 * 1024 * 1024, "upload", out)
        bar.update(1024 * 1024)
        bar.update(1024 * 1024)
        bar.close()
        bar.close()  # idempotent
        text = out.getvalue()
        assert text.endswith("\n") and text.count("\n") == 1
        shown = lines(text)
        assert shown[0].startswith("tdstore upload:  25% |######------------------| 1.0 MiB/4.0 MiB")
        assert shown[1].startswith("tdstore upload:  50% |")
        assert shown[-1].startswith("tdstore upload:  50% |############------------| 2.0 MiB/4.0 MiB")

    def test_delay_hides_short_transfers(self):
        out = io.StringIO()
        bar = _progress.Progress(100, "download", out, delay=60)
        bar.update(100)
        bar.close()
        assert out.getvalue() == ""

    def test_redraws_are_throttled(self, monkeypatch):
        monkeypatch.setattr(_progress, "REDRAW_S", 60)
        out = io.StringIO()
        bar = _progress.Progress(1000, "upload", out)
        for _ in range(1000):
            bar.update(1)
        bar.close()
        assert len(lines(out.getvalue())) == 2, "the first update and the final line"

    def test_a_broken_stream_does_not_break_the_transfer(self):
        out = io.StringIO()
        out.close()
        bar = _progress.Progress(10, "upload", out)
        bar.update(5)
        bar.close()

    def test_empty_transfer(self):
        out = io.StringIO()
        with _progress.Progress(0, "upload", out) as bar:
            bar.update(0)
        assert "100%" in out.getvalue()


# ------------------------------------------------------------------ transfers with a bar
class TestTransfers:
    def test_upload_and_download(self, conn, client, capsys):
        td = sample()
        store = TensorDictStore.from_tensordict(td, progress=True, **conn)
        try:
            err = capsys.readouterr().err
            assert "tdstore upload: 100%" in lines(err)[-1]
            assert len(lines(err)) >= 5, "the bar moved in steps"
            keys = sorted(k.decode().split(":", 2)[2] for k in client.keys("*"))
            expected = ["d:big", "d:nest.empty", "d:nest.x", "d:small", "d:text", "meta", "reg", "wv"]
            assert keys == expected, "no tmp key left"
            assert client.pttl(f"tensordict:{{{store.td_id}}}:d:big") == -1, "the tmp TTL is gone"
            out = store.to_tensordict(progress=True)
            err = capsys.readouterr().err
            assert "tdstore download: 100%" in lines(err)[-1]
            assert (out == td).all() and out["text"] == "hello"
        finally:
            store.clear_redis()
            store.close()

    def test_same_wire_state_as_without_a_bar(self, conn, client, wire, server):
        td = sample()
        a = TensorDictStore.from_tensordict(td, progress=True, prefix="a", **conn)
        b = TensorDictStore.from_tensordict(td, progress=False, prefix="b", **conn)
        try:
            state = wire(server)

            def of(prefix, store):
                base = f"{prefix}:{{{store.td_id}}}:"
                out = {k.decode()[len(base):]: v for k, v in state.items() if k.decode().startswith(base)}
                out["meta"] = (out["meta"][0], {f: v for f, v in out["meta"][1].items() if f not in (b"lv", b"created")})
                return out

            assert of("a", a) == of("b", b)
        finally:
            for s in (a, b):
                s.clear_redis()
                s.close()

    def test_from_schema_zero_fill_in_chunks(self, conn, client, capsys):
        store = TensorDictStore.from_schema(
            {"obs": ([100_000], torch.uint8), ("n", "r"): ([], torch.float32), "none": ([0], torch.float32)},
            batch_size=[7],
            progress=True,
            **conn,
        )
        try:
            err = capsys.readouterr().err
            assert "tdstore upload: 100%" in lines(err)[-1] and "683.6 KiB/683.6 KiB" in lines(err)[-1]
            assert client.strlen(f"tensordict:{{{store.td_id}}}:d:obs") == 700_000
            assert store["obs"].sum() == 0 and store["n", "r"].shape == (7,)
            assert not [k for k in client.keys("*") if b":tmp:" in k]
        finally:
            store.clear_redis()
            store.close()

    def test_chunk_boundaries(self, conn, client):
        """Entries one byte around each chunk boundary arrive byte for byte, both ways."""
        c, z = _transfer.CHUNK, _transfer.ZERO_CHUNK
        gen = torch.Generator().manual_seed(1)
        sizes = [0, 1, c - 1, c, c + 1, 2 * c, 2 * c + 7]
        td = TensorDict({f"e{n}": torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for n in sizes}, [])
        store = TensorDictStore.from_tensordict(td, progress=True, **conn)
        zeros = TensorDictStore.from_schema(
            {f"z{n}": ([n], torch.uint8) for n in (1, z - 1, z, z + 1, 3 * z)}, progress=True, **conn
        )
        try:
            for n in sizes:
                assert client.strlen(f"tensordict:{{{store.td_id}}}:d:e{n}") == n
            for progress in (True, False):
                out = store.to_tensordict(progress=progress)
                for n in sizes:
                    assert torch.equal(out[f"e{n}"], td[f"e{n}"]), (n, progress)
            for n in (1, z - 1, z, z + 1, 3 * z):
                assert client.strlen(f"tensordict:{{{zeros.td_id}}}:d:z{n}") == n
                assert int(zeros[f"z{n}"].sum()) == 0
        finally:
            for s in (store, zeros):
                s.clear_redis()
                s.close()

    def test_evicted_entry_is_reported_not_zero_filled(self, conn, client):
        """A data key gone without a write (evicted, deleted by hand): DataLostError, small or chunked."""
        store = TensorDictStore.from_tensordict(sample(), **conn)
        try:
            for key in ("small", "big"):
                store.update(sample())  # every entry back in place
                client.delete(f"tensordict:{{{store.td_id}}}:d:{key}")
                with pytest.raises(tdstore.DataLostError, match=f"entry \\('{key}',\\)"):
                    store.to_tensordict(progress=True)
        finally:
            store.clear_redis()
            store.close()

    def test_with_a_lifetime(self, conn, client):
        """The staged tmp keys' own TTL (10 min) gives way to the store's expiry on rename."""
        schema = {"obs": ([100_000], torch.uint8), "r": ([], torch.float32)}
        stores = [
            TensorDictStore.from_tensordict(sample(), progress=True, expire=30, **conn),
            TensorDictStore.from_schema(schema, batch_size=[3], progress=True, expire=30, **conn),
        ]
        try:
            for store in stores:
                keys = client.keys(f"tensordict:{{{store.td_id}}}:*")
                assert len(keys) >= 4 and not [k for k in keys if b":tmp:" in k]
                assert all(0 < client.pttl(k) <= 30_000 for k in keys), {k: client.pttl(k) for k in keys}
        finally:
            for store in stores:
                store.clear_redis()
                store.close()

    def test_whole_entry_write_shows_a_bar(self, conn, capsys):
        store = TensorDictStore(batch_size=[4], progress=True, **conn)
        try:
            capsys.readouterr()
            store["x"] = torch.ones(4, 40_000)
            assert "tdstore upload: 100%" in lines(capsys.readouterr().err)[-1]
            assert torch.equal(store["x"], torch.ones(4, 40_000))
        finally:
            store.clear_redis()
            store.close()

    def test_nested_handle_and_store_setting(self, conn, capsys):
        store = TensorDictStore.from_tensordict(sample(), progress=False, **conn)
        try:
            store.to_tensordict()
            store["nest"].to_tensordict()
            assert capsys.readouterr().err == "", "progress=False on the store holds for its nested handles"
            store["nest"].to_tensordict(progress=True)
            assert "tdstore download: 100%" in capsys.readouterr().err
        finally:
            store.clear_redis()
            store.close()


# ------------------------------------------------------------------ quiet unless asked or on a terminal
class TestQuiet:
    def test_not_a_terminal_prints_nothing(self, conn, capsys):
        store = TensorDictStore.from_tensordict(sample(), **conn)
        try:
            store.to_tensordict()
            schema = {"z": ([1000], torch.uint8)}
            TensorDictStore.from_schema(schema, batch_size=[100], td_id=store.td_id + "z", **conn).clear_redis()
            assert capsys.readouterr().err == ""
        finally:
            store.clear_redis()
            store.close()

    @pytest.mark.parametrize("how", ["argument", "set_progress", "env"])
    def test_switched_off_on_a_terminal(self, conn, monkeypatch, how):
        tty = TTY()
        monkeypatch.setattr(sys, "stderr", tty)
        kwargs = {}
        if how == "argument":
            kwargs["progress"] = False
        elif how == "set_progress":
            tdstore.set_progress(False)
        else:
            monkeypatch.setenv("TDSTORE_PROGRESS", "0")
        store = TensorDictStore.from_tensordict(sample(), **kwargs, **conn)
        try:
            store.to_tensordict()
            assert tty.getvalue() == ""
            if how != "argument":
                store.to_tensordict(progress=True)
                assert "tdstore download: 100%" in tty.getvalue(), "an argument wins over the switches"
        finally:
            store.clear_redis()
            store.close()

    def test_automatic_on_a_terminal(self, conn, monkeypatch):
        tty = TTY()
        monkeypatch.setattr(sys, "stderr", tty)
        store = TensorDictStore.from_tensordict(sample(), **conn)
        try:
            assert "tdstore upload: 100%" in tty.getvalue()
            monkeypatch.setattr(_progress, "AUTO_DELAY_S", 60.0)
            before = tty.getvalue()
            store.to_tensordict()
            assert tty.getvalue() == before, "a transfer shorter than the delay prints nothing"
        finally:
            store.clear_redis()
            store.close()


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from tensordict import TensorDict
    from tdstore import TensorDictStore
    from tdstore._core import progress as _progress
    from tdstore._backend import transfer as _transfer
    _transfer.CHUNK = 64 * 1024
    _progress.AUTO_MIN_BYTES = 1
    _progress.AUTO_DELAY_S = 0.0
    store = TensorDictStore.from_tensordict(
        TensorDict({"x": torch.ones(4, 50_000)}, [4]), host=sys.argv[1], port=int(sys.argv[2])
    )
    assert torch.equal(store.to_tensordict()["x"], torch.ones(4, 50_000))
    store.clear_redis()
    print("child done", flush=True)
    """
)


def _run_child(redis_server, *, tty: bool, env: dict[str, str]) -> tuple[str, str]:
    kw = redis_server.connection_kwargs()
    cmd = [sys.executable, "-c", _CHILD, kw["host"], str(kw["port"])]
    full_env = {**os.environ, **env}
    if "TDSTORE_PROGRESS" not in env:
        full_env.pop("TDSTORE_PROGRESS", None)
    if not tty:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=full_env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, proc.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, env=full_env)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    out, _ = proc.communicate(timeout=30)
    os.close(master)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return out.decode(), b"".join(chunks).decode(errors="replace")


class TestTerminal:
    """A child process whose stderr is a real pseudo-terminal (or a pipe)."""

    def test_bar_on_a_pseudo_terminal(self, redis_server):
        out, err = _run_child(redis_server, tty=True, env={})
        assert "child done" in out
        assert "tdstore upload: 100%" in err and "tdstore download: 100%" in err

    def test_quiet_on_a_pipe(self, redis_server):
        out, err = _run_child(redis_server, tty=False, env={})
        assert "child done" in out and err == ""

    def test_env_switch_on_a_pseudo_terminal(self, redis_server):
        out, err = _run_child(redis_server, tty=True, env={"TDSTORE_PROGRESS": "0"})
        assert "child done" in out and "tdstore" not in err


# ------------------------------------------------------------------ atomicity is unchanged
class TestAtomicity:
    def test_nothing_is_visible_before_the_commit(self, conn, client, monkeypatch):
        seen = []
        update = _progress.Progress.update

        def spy(self, nbytes):
            # during the upload only tmp keys exist: no meta, registry or data key
            seen.append(sorted(k.decode().split(":", 2)[2].split(":")[0] for k in client.keys("*")))
            update(self, nbytes)

        monkeypatch.setattr(_progress.Progress, "update", spy)
        store = TensorDictStore.from_tensordict(sample(), progress=True, **conn)
        try:
            assert len(seen) >= 4
            assert all(set(keys) <= {"tmp"} for keys in seen), seen
            assert seen[-1] and set(seen[-1]) == {"tmp"}
        finally:
            store.clear_redis()
            store.close()

    def test_failure_mid_upload_leaves_nothing(self, conn, client, monkeypatch):
        calls = []

        def failing(self, nbytes):
            calls.append(nbytes)
            if len(calls) == 3:
                raise RuntimeError("the transfer broke off")

        monkeypatch.setattr(_progress.Progress, "update", failing)
        before = sorted(client.keys("*"))
        with pytest.raises(RuntimeError, match="broke off"):
            TensorDictStore.from_tensordict(sample(), progress=True, td_id="interrupted", **conn)
        assert sorted(client.keys("*")) == before, "the tmp keys sent so far were deleted"
        with pytest.raises(tdstore.StoreNotFoundError):
            TensorDictStore.from_store(td_id="interrupted", **conn)

    def test_refused_commit_leaves_the_existing_store(self, conn, client, wire, server):
        first = TensorDictStore.from_dict({"a": torch.zeros(3)}, batch_size=[3], td_id="taken", **conn)
        try:
            before = wire(server)
            with pytest.raises(StoreExistsError):
                TensorDictStore.from_tensordict(sample(), progress=True, td_id="taken", **conn)
            assert wire(server) == before, "the script deleted the staged tmp keys"
        finally:
            first.clear_redis()
            first.close()

    def test_download_is_one_snapshot_under_writers(self, server, conn, request, monkeypatch):
        """A writer replaces two entries together while a reader downloads with a bar:
        every download holds both from the same write."""
        size = 40_000  # 160 KB per entry: read in several GETRANGE chunks
        store = TensorDictStore.from_dict({"a": torch.zeros(size), "b": torch.zeros(size)}, batch_size=[], **conn)
        stale = [0]
        read_staged = _transfer.read_staged

        async def counting(*args, **kwargs):
            got = await read_staged(*args, **kwargs)
            stale[0] += got is _transfer.STALE
            return got

        monkeypatch.setattr(_transfer, "read_staged", counting)
        stop = threading.Event()
        errors: list[BaseException] = []

        def writer():
            handle = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
            try:
                i = 1
                end = time.monotonic() + 20
                while not stop.is_set() and i < 2000 and time.monotonic() < end:
                    handle.update({"a": torch.full((size,), float(i)), "b": torch.full((size,), float(i))})
                    i += 1
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)
            finally:
                handle.close()

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        torn = reads = 0
        try:
            end = time.monotonic() + 10
            while reads < 40 and time.monotonic() < end:
                td = store.to_tensordict(progress=True)
                reads += 1
                a, b = td["a"], td["b"]
                if not (torch.equal(a, b) and bool((a == a[0]).all())):
                    torn += 1
        finally:
            stop.set()
            thread.join(30)
            store.clear_redis()
            store.close()
        record(request, torn_reads=torn, reads=reads, stale_retries=stale[0])
        assert not errors, errors
        assert reads >= 5
        assert torn == 0

    def test_no_chunking_without_a_bar(self, conn, monkeypatch):
        async def refuse(*args, **kwargs):
            raise AssertionError("a transfer without a bar must not be chunked")

        monkeypatch.setattr(_transfer, "commit_staged", refuse)
        monkeypatch.setattr(_transfer, "read_staged", refuse)
        store = TensorDictStore.from_tensordict(sample(), **conn)
        try:
            assert (store.to_tensordict() == sample()).all()
            store["big"] = torch.ones(4, 50_000)
        finally:
            store.clear_redis()
            store.close()
