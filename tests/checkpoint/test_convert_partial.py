"""Leftovers of killed conversions: a rerun of ``flowlock convert`` (or ``--clean DST``) removes the
``.DST.<hex>.partial`` directories no live process holds and keeps the ones a live conversion holds.

The live conversion is a real ``flowlock convert`` in a subprocess, paused after its first tensor
read: it says so on its stdout and waits on its stdin, so the test knows (without sleeping) that it
is mid-conversion with its partial directory created and locked, then kills it with SIGKILL.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from h3_checkpoints import save_diffusers

from flowlock.checkpoint import sweep_partials, verify_directory
from flowlock.checkpoint.partial import PartialDirectory, partial_dirs
from flowlock.cli import main

PAUSED = "paused after the first tensor"


def start_paused_conversion(src, dst) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        import sys
        from flowlock.checkpoint.directory import SafetensorsDirectory
        from flowlock.cli import main

        read = SafetensorsDirectory.load

        def load_then_pause(self, name):
            tensor = read(self, name)
            print({PAUSED!r}, flush=True)
            sys.stdin.readline()  # blocks until the test writes a line or closes the pipe
            return tensor

        SafetensorsDirectory.load = load_then_pause
        sys.exit(main(["convert", {str(src)!r}, {str(dst)!r}, "--to", "native"]))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.strip() != PAUSED:
        proc.kill()
        raise AssertionError(f"the conversion did not pause: {line!r} {proc.communicate()[1]}")
    return proc


@pytest.fixture
def src(tiny_model, tmp_path):
    return save_diffusers(tiny_model, tmp_path / "src", "150KB")


def test_a_rerun_after_sigkill_removes_the_leftover_and_succeeds(capsys, src, tmp_path):
    dst = tmp_path / "dst"
    proc = start_paused_conversion(src, dst)
    try:
        (live,) = partial_dirs(dst)
        # Held by the live conversion: neither --clean nor a sweep touches it.
        assert main(["convert", "--clean", str(dst)]) == 0
        assert f"kept {live}: a live conversion holds it" in capsys.readouterr().out
        assert sweep_partials(dst).held == (live,) and live.is_dir()
    finally:
        proc.kill()  # SIGKILL: no handler, no cleanup in the process
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert partial_dirs(dst) == [live] and not dst.exists()  # the leftover the issue reports

    assert main(["convert", str(src), str(dst), "--to", "native"]) == 0
    out = capsys.readouterr().out
    assert f"removed {live}: a partial directory no live conversion holds" in out and f"wrote {dst}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "src"]
    verify_directory(dst)


def test_clean_removes_only_unheld_partials_of_that_dst(capsys, tmp_path):
    dst = tmp_path / "dst"
    stale = tmp_path / ".dst.0123456789abcdef.partial"  # as a killed (or older) conversion leaves it
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "model-00001-of-00002.safetensors").write_bytes(b"x" * 10)
    held = PartialDirectory(dst)
    others = [tmp_path / ".dst.b.0123456789abcdef.partial", tmp_path / ".dst2.0123456789abcdef.partial",
              tmp_path / ".dst.0123456789abcdeg.partial", tmp_path / "dst.0123456789abcdef.partial"]
    for path in others:
        path.mkdir()
    (tmp_path / ".dst.fedcba9876543210.partial").write_text("a file, not a directory")
    (tmp_path / ".dst.00000000000000aa.partial").symlink_to(tmp_path / "dst.0123456789abcdef.partial")
    try:
        assert main(["convert", "--clean", str(dst)]) == 0
        out = capsys.readouterr().out
        assert f"removed {stale}:" in out and f"kept {held.path}:" in out
        assert not stale.exists() and held.path.is_dir()
        assert all(path.is_dir() for path in others)
        assert (tmp_path / ".dst.fedcba9876543210.partial").is_file()
        assert (tmp_path / ".dst.00000000000000aa.partial").is_symlink()
        assert not dst.exists()
    finally:
        held.release()
    assert main(["convert", "--clean", str(dst)]) == 0  # released: now it is stale
    assert f"removed {held.path}:" in capsys.readouterr().out and not held.path.exists()
    assert main(["convert", "--clean", str(dst)]) == 0
    assert f"no partial directory of {dst}" in capsys.readouterr().out


def test_a_partial_directory_is_locked_from_its_creation(tmp_path):
    held = PartialDirectory(tmp_path / "dst")
    try:
        assert held.path.parent == tmp_path and (held.path.stat().st_mode & 0o777) == 0o700
        assert sweep_partials(tmp_path / "dst").held == (held.path,)
    finally:
        held.release()
    assert sweep_partials(tmp_path / "dst").removed == (held.path,)


@pytest.mark.parametrize("sweep_at", ["mkdir", "flock"])
def test_a_sweep_between_creation_and_lock_costs_a_new_name_not_the_lock(monkeypatch, tmp_path, sweep_at):
    # A sweep right after the mkdir (directory not yet locked) or while the creator waits for the lock
    # (the sweep holds it and removes the directory): the creator must end up holding a live directory.
    import flowlock.checkpoint.partial as partial

    swept = []
    if sweep_at == "mkdir":
        real = os.mkdir

        def hook(path, mode):
            real(path, mode)
            if not swept:
                swept.append(sweep_partials(tmp_path / "dst"))

        monkeypatch.setattr(partial.os, "mkdir", hook)
    else:
        real = partial.fcntl.flock

        def hook(fd, op):
            if not swept:  # the sweep's own lock is taken on another descriptor while this one waits
                monkeypatch.setattr(partial.fcntl, "flock", real)
                swept.append(sweep_partials(tmp_path / "dst"))
            real(fd, op)

        monkeypatch.setattr(partial.fcntl, "flock", hook)
    held = PartialDirectory(tmp_path / "dst")
    try:
        assert len(swept) == 1 and len(swept[0].removed) == 1 and swept[0].removed[0] != held.path
        assert partial_dirs(tmp_path / "dst") == [held.path]
        assert sweep_partials(tmp_path / "dst").held == (held.path,)
    finally:
        held.release()


@pytest.mark.parametrize("argv, message", [
    (["convert", "--clean", "SRC", "DST"], "--clean takes DST alone"),
    (["convert", "--clean", "DST", "--to", "native"], "--clean takes DST alone"),
    (["convert", "--clean", "DST", "--verify"], "--clean takes DST alone"),
    (["convert", "--clean", "DST", "--allow-nonfinite"], "--clean takes DST alone"),
    (["convert", "--clean", "DST", "--qkv-layout", "stacked"], "--clean takes DST alone"),
    (["convert", "DST", "--to", "native"], "SRC, DST and --to are required"),
    (["convert", "SRC", "DST"], "SRC, DST and --to are required"),
])
def test_clean_and_convert_arguments_are_checked(capsys, tmp_path, argv, message):
    assert main([a if a not in ("SRC", "DST") else str(tmp_path / a) for a in argv]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_clean_with_a_missing_parent(capsys, tmp_path):
    assert main(["convert", "--clean", str(tmp_path / "no" / "dst")]) == 1
    assert "(the parent of DST) is not a directory" in capsys.readouterr().err
