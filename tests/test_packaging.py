"""Packaging and container files: the wheel, a fresh install of it, docker/compose.yml.

* The wheel is built (``pip wheel --no-deps --no-build-isolation``) from a copy of the
  source tree, so the test neither writes ``build/`` into the checkout nor depends on it.
  ``tdstore/lua`` is a symlink to ``../lua`` in the repository: the wheel must hold the
  scripts themselves, as regular files.
* A virtual environment gets the wheel with ``--no-deps``; a ``.pth`` file makes it reuse this
  interpreter's packages (torch, ...), whether the suite runs from the system Python or a venv; from a directory outside the source tree, its ``tdstore``
  command answers and ``python -m tdstore demo`` runs with ``violations=0``, importing
  tdstore from the venv.
* ``docker/compose.yml`` cannot be run here (no Docker engine): it is parsed and checked
  for its profiles, pinned image tags and loopback-only ports, and the README's test
  command for each profile.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
LUA_FILES = sorted(p.relative_to(ROOT / "lua").as_posix() for p in (ROOT / "lua").rglob("*.lua"))
BUILD_TIMEOUT = 300
DEMO_TIMEOUT = 300


def _copy_source(dest: Path) -> Path:
    src = dest / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "lua", src / "lua", ignore=ignore)
    # symlinks=True: the copy keeps tdstore/lua -> ../lua, as in the repository
    shutil.copytree(ROOT / "tdstore", src / "tdstore", symlinks=True, ignore=ignore)
    assert (src / "tdstore" / "lua").is_symlink() == (ROOT / "tdstore" / "lua").is_symlink()
    return src


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = _copy_source(tmp)
    out = tmp / "dist"
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    # with this environment's setuptools when it can build wheels (no index needed); a venv's
    # bundled setuptools may be too old for that (no bdist_wheel): then in pip's isolated build
    done = subprocess.run(command[:5] + ["--no-build-isolation"] + command[5:], capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT)
    if done.returncode != 0 and "bdist_wheel" in done.stdout + done.stderr:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = list(out.glob("tdstore-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_wheel_holds_the_lua_scripts_as_files_and_py_typed(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        infos = {i.filename: i for i in zf.infolist()}
        for rel in LUA_FILES:
            name = f"tdstore/lua/{rel}"
            assert name in infos, f"{name} missing from {wheel.name}"
            info = infos[name]
            mode = info.external_attr >> 16
            assert mode == 0 or (mode & 0o170000) == 0o100000, f"{name} is not a regular file in the wheel"
            assert zf.read(name) == (ROOT / "lua" / rel).read_bytes()
        assert "tdstore/py.typed" in infos
        assert "tdstore/cli/commands.py" in infos and "tdstore/__main__.py" in infos
        assert not [n for n in infos if n.startswith(("tests/", "benchmarks/", "docs/"))]
        dist_info = next(n.split("/")[0] for n in infos if n.endswith(".dist-info/METADATA"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
        assert re.search(r"^tdstore = tdstore\.cli:main$", entry_points, re.M), entry_points
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        for extra in ("server", "torchrl", "docs", "test"):
            assert f"Provides-Extra: {extra}" in metadata, extra


def _site_dirs() -> list[str]:
    """The site-packages folders of this interpreter: its venv's, the base's, the user's."""
    dirs = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    return list(dict.fromkeys(dirs))


def _reuse_site_packages(python: Path) -> None:
    """Makes the venv of ``python`` see this interpreter's packages (torch, tensordict, redis ...).

    ``python -m venv --system-site-packages`` would reuse the *base* interpreter's packages only,
    which lack torch when this suite itself runs inside a virtual environment. A ``.pth`` file
    that lists this interpreter's site-packages folders works from the system Python and from a
    venv alike. Its lines are plain paths: ``.pth`` files inside those folders are not run, so an
    editable install of tdstore there cannot shadow the wheel installed into the venv, whose own
    site-packages comes first on ``sys.path``.
    """
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    dirs = _site_dirs()
    assert dirs, f"no site-packages folder on {sys.executable}'s sys.path: {sys.path}"
    Path(purelib).mkdir(parents=True, exist_ok=True)
    (Path(purelib) / "_tdstore_test_reuse.pth").write_text("".join(f"{d}\n" for d in dirs))


@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT + DEMO_TIMEOUT + 120)
def test_fresh_venv_installs_the_wheel_and_runs_the_demo(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # --without-pip: no ensurepip needed (Debian's python3 lacks it without python3-venv);
    # this process's pip installs into the venv through --python
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    _reuse_site_packages(python)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True, text=True, timeout=BUILD_TIMEOUT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TDSTORE_URL", "TDSTORE_DEMO_SERVER")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"

    where = subprocess.run(
        [str(python), "-c", "import tdstore, tdstore._backend.scripts as s, pathlib; "
         "p = pathlib.Path(tdstore.__file__).parent; print(p); "
         "print(sorted(x.name for x in (p / 'lua').glob('*.lua'))); print((p / 'lua').is_symlink())"],
        capture_output=True, text=True, cwd=elsewhere, env=env, timeout=120,
    )
    assert where.returncode == 0, where.stderr
    package_dir, lua_names, is_link = where.stdout.splitlines()
    assert Path(package_dir).is_relative_to(venv), f"tdstore imported from {package_dir}, not from the venv"
    assert eval(lua_names) == sorted(Path(n).name for n in LUA_FILES if "/" not in n)  # noqa: S307 - our own output
    assert is_link == "False"

    helped = subprocess.run([str(venv / "bin" / "tdstore"), "--help"], capture_output=True, text=True,
                            cwd=elsewhere, env=env, timeout=120)
    assert helped.returncode == 0 and "serve" in helped.stdout, helped.stderr

    demo = subprocess.run(
        [str(python), "-m", "tdstore", "demo", "--server", "redis", "--seconds", "1", "--actors", "1"],
        capture_output=True, text=True, cwd=elsewhere, env=env, timeout=DEMO_TIMEOUT,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "violations=0" in demo.stdout
    assert "server stopped" in demo.stdout


# --------------------------------------------------------------------------- docker
COMPOSE = ROOT / "docker" / "compose.yml"
PROFILES = ("redis", "valkey", "dragonfly", "keydb", "cluster")
TEST_URLS = {
    "redis": "redis://127.0.0.1:6379/0",
    "valkey": "redis://127.0.0.1:6380/0",
    "dragonfly": "redis://127.0.0.1:6381/0",
    "keydb": "redis://127.0.0.1:6382/0",
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    with open(COMPOSE) as fh:
        doc = yaml.safe_load(fh)
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict)
    return doc


def test_compose_has_every_profile(compose: dict[str, Any]) -> None:
    services = compose["services"]
    by_profile: dict[str, list[str]] = {}
    for name, svc in services.items():
        assert svc.get("profiles"), f"service {name} has no profile: it would start on a bare `up`"
        assert "all" in svc["profiles"], f"service {name} is missing from the `all` profile"
        for profile in svc["profiles"]:
            by_profile.setdefault(profile, []).append(name)
    for profile in PROFILES:
        assert by_profile.get(profile), f"no service in profile {profile!r}"
    cluster = by_profile["cluster"]
    nodes = [n for n in cluster if services[n].get("healthcheck")]
    assert len(nodes) == 3, cluster
    init = [n for n in cluster if n not in nodes]
    assert len(init) == 1
    command = " ".join(services[init[0]]["command"])
    assert "--cluster create" in command
    for node in nodes:
        port = str(services[node]["command"][services[node]["command"].index("--port") + 1])
        assert f"127.0.0.1:{port}" in command
        assert services[node]["command"][services[node]["command"].index("--cluster-enabled") + 1] == "yes"
    assert set(services[init[0]]["depends_on"]) == set(nodes)


def test_compose_images_are_pinned_and_ports_loopback_only(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag, f"service {name}: image {image!r} has no tag"
        assert tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"service {name}: tag {tag!r} is not a pinned version"
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"service {name} publishes {port!r} beyond loopback"
        if svc.get("network_mode") == "host":
            command = svc["command"]
            text = " ".join(command) if isinstance(command, list) else str(command)
            if "redis-server" in text:
                assert "--bind 127.0.0.1" in text, f"service {name} shares the host network without --bind 127.0.0.1"
        else:
            assert svc.get("ports"), f"service {name} is reachable from nowhere"


def test_compose_readme_says_how_to_test_each_profile() -> None:
    readme = (ROOT / "docker" / "README.md").read_text()
    for profile in PROFILES:
        assert f"--profile {profile}" in readme, profile
    for profile, url in TEST_URLS.items():
        assert f"| `{profile}` | `python -m pytest --server-url {url}` |" in readme, profile
    compose_text = COMPOSE.read_text()
    for url in TEST_URLS.values():
        port = url.rsplit(":", 1)[1].split("/")[0]
        assert f'"127.0.0.1:{port}:' in compose_text, port
