"""The CPU kernels' cache (engine/cpu/build.py) is private: its directories are made mode 0700,
and a library, or a directory holding one, that is another user's or that others may write is
never loaded (another local user could have planted it). The build is a small C file: what is
checked does not depend on the sources (tests/test_cpu_kernels.py builds the real ones)."""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.cpu import build as kernel_build


def _no_compiler() -> bool:
    try:
        kernel_build.compiler()
    except RuntimeError:
        return True
    return False


pytestmark = pytest.mark.skipif(_no_compiler(), reason="no C compiler")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Both of the cache's places under tmp_path, a fresh-dir fallback of this test's own,
    and a umask that would leave group-writable files and directories if the build kept it."""
    monkeypatch.delenv("TANDEM_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(kernel_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(mode=0o755)
    kernel_build._fresh_place.cache_clear()
    old_umask = os.umask(0o002)
    yield
    os.umask(old_umask)
    kernel_build._fresh_place.cache_clear()


@pytest.fixture
def csrc(tmp_path) -> Path:
    root = tmp_path / "csrc"
    root.mkdir()
    (root / "small.c").write_text("int tandem_small(int x) { return 2 * x; }\n")
    return root


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _works(library: Path) -> bool:
    """Whether `library` is the small source's build. Loaded through a copy of its own name:
    the dynamic loader hands back a library already loaded under the same path."""
    copy = library.parent.parent / f"check-{os.urandom(8).hex()}.so"
    shutil.copy(library, copy)
    return ctypes.CDLL(str(copy)).tandem_small(21) == 42


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == kernel_build.__name__]


def test_the_cache_and_its_missing_parents_are_made_private(tmp_path, csrc):
    library = kernel_build.build(csrc)
    kernels = tmp_path / "xdg" / "tandem" / "kernels"
    assert library.parent.parent == kernels
    for path in (tmp_path / "xdg", kernels.parent, kernels, library.parent, library):
        assert _mode(path) == 0o700, path  # the umask's 0o775 would let the group plant a file
    assert _works(library)


def test_a_good_cache_is_reused_without_a_rebuild(csrc, monkeypatch, caplog):
    library = kernel_build.build(csrc)
    built = library.stat()
    monkeypatch.setattr(kernel_build, "_compile", lambda *args: pytest.fail("rebuilt"))
    with caplog.at_level("WARNING", logger=kernel_build.__name__):
        assert kernel_build.build(csrc) == library
    assert library.stat().st_ino == built.st_ino and not _refusals(caplog)


def test_the_configured_cache_is_made_private_too(tmp_path, csrc, monkeypatch):
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "mine" / "kernels"))
    library = kernel_build.build(csrc)
    assert library.is_relative_to(tmp_path / "mine" / "kernels")
    assert _mode(tmp_path / "mine") == _mode(tmp_path / "mine" / "kernels") == 0o700


def _planted(tmp_path: Path, csrc: Path) -> Path:
    """The cache's library for `csrc` replaced by another (its function returns 0), as if
    another user had planted it."""
    library = kernel_build.build(csrc)
    (tmp_path / "planted.c").write_text("int tandem_small(int x) { return 0; }\n")
    cc = kernel_build.compiler()
    cmd = [cc, "-shared", "-fPIC", str(tmp_path / "planted.c"), "-o", str(library)]
    subprocess.run(cmd, check=True)
    assert not _works(library)
    return library


@pytest.mark.parametrize("loose", ["root", "key dir"])
def test_a_library_in_a_directory_others_may_write_is_refused(tmp_path, csrc, caplog, loose):
    planted = _planted(tmp_path, csrc)
    (planted.parent.parent if loose == "root" else planted.parent).chmod(0o777)
    with caplog.at_level("WARNING", logger=kernel_build.__name__):
        library = kernel_build.build(csrc)
    assert library != planted and _works(library)
    assert library.is_relative_to(tmp_path / "tmp")  # the per-user temp dir, private
    loose_dir = planted.parent.parent if loose == "root" else planted.parent
    assert any(
        str(loose_dir) in m and "writable by its group or others (mode 777)" in m
        for m in _refusals(caplog)
    ), _refusals(caplog)


def test_a_library_others_may_write_is_refused_and_built_again(tmp_path, csrc, caplog):
    planted = _planted(tmp_path, csrc)
    planted.chmod(0o666)
    with caplog.at_level("WARNING", logger=kernel_build.__name__):
        library = kernel_build.build(csrc)
    assert library == planted  # its directory is still private: rebuilt in place
    assert _works(library) and _mode(library) == 0o700
    assert any(f"refusing to load {planted}" in m and "mode 666" in m for m in _refusals(caplog))


def test_a_cache_another_user_owns_is_refused(tmp_path, csrc, monkeypatch, caplog):
    """Owned by another uid (simulated: this process takes itself for another user): neither
    the cache nor the predictable temp dir is used, a fresh private dir is."""
    planted = _planted(tmp_path, csrc)
    (tmp_path / "tmp" / f"tandem-kernels-{os.getuid() + 1}").mkdir(mode=0o700)
    monkeypatch.setattr(kernel_build, "_uid", lambda: os.getuid() + 1)
    with caplog.at_level("WARNING", logger=kernel_build.__name__):
        library = kernel_build.build(csrc)
    assert library != planted and _works(library)
    fresh = library.parent
    assert fresh.parent == tmp_path / "tmp" and fresh.name.startswith("tandem-kernels-")
    assert fresh.name != f"tandem-kernels-{os.getuid() + 1}" and _mode(fresh) == 0o700
    messages = _refusals(caplog)
    assert any(str(planted.parent.parent) in m and "owned by uid" in m for m in messages)
    assert any("for this process only" in m for m in messages), messages


def test_a_planted_temp_dir_is_not_used(tmp_path, csrc, monkeypatch, caplog):
    """The per-user temp dir's name is predictable: another user may make it first."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(blocker / "cache"))  # cannot be made
    predictable = tmp_path / "tmp" / f"tandem-kernels-{os.getuid()}"
    predictable.mkdir()
    predictable.chmod(0o777)
    with caplog.at_level("WARNING", logger=kernel_build.__name__):
        library = kernel_build.build(csrc)
    assert not library.is_relative_to(predictable) and _works(library)
    assert any(str(predictable) in m for m in _refusals(caplog))


def test_builds_at_once_each_find_a_whole_library(csrc):
    """Two builds of one key (pytest-xdist's workers, two servers) both end with a loadable
    library: each links in a temp dir of its own and renames."""
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: kernel_build.build(csrc), range(2))
    assert first == second and _works(first)


def test_a_shared_volume_above_the_cache_is_not_checked(tmp_path, csrc, caplog):
    """docker/k8s/deployment.yaml mounts an emptyDir (root's, mode 0777) at ~/.cache: the
    directories above the cache are not Tandem's, only the cache's own are checked."""
    volume = tmp_path / "xdg"
    volume.mkdir()
    volume.chmod(0o777)
    with caplog.at_level("WARNING", logger=kernel_build.__name__):
        library = kernel_build.build(csrc)
    assert library.is_relative_to(volume / "tandem" / "kernels") and not _refusals(caplog)
    assert _mode(volume / "tandem") == 0o700
