"""Streaming and atomicity of :func:`convert_directory`, through its reading and writing seams.

Memory: every tensor read from the source and every tensor handed to the writer is tracked with a
weakref finalizer, so at each read we know the bytes still alive. The bound asserted is the issue's:
one shard plus one q/k/v group; the harness is itself shown to fail on a converter that keeps what
it reads.
"""

import os
import signal
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from h3_checkpoints import save_diffusers

from flowlock.checkpoint import H3Geometry, convert_directory
from flowlock.checkpoint.convert import save_shard
from flowlock.checkpoint.directory import SafetensorsDirectory, header_bytes


class Ledger:
    """Bytes of tracked tensors alive now, the peak at any read, and whether an earlier shard outlived its write."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.reads = 0
        self.written: list[list[weakref.ref]] = []
        self.stale_reads = 0
        self.shard_bytes: list[int] = []

    def track(self, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.live += size
        weakref.finalize(tensor, self._free, size)

    def _free(self, size: int) -> None:
        self.live -= size

    def on_read(self) -> None:
        self.reads += 1
        self.peak = max(self.peak, self.live)
        if any(ref() is not None for shard in self.written for ref in shard):
            self.stale_reads += 1


def counting_source(ledger: Ledger, retain: bool = False):
    kept = []

    class Counting(SafetensorsDirectory):
        def load(self, name):
            tensor = super().load(name)
            ledger.track(tensor)
            ledger.on_read()
            if retain:  # the planted defect: a converter that keeps everything it reads
                kept.append(tensor)
            return tensor

    return Counting


def counting_writer(ledger: Ledger):
    def write(tensors, path):
        ledger.shard_bytes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        save_shard(tensors, path)
        ledger.written.append([weakref.ref(t) for t in tensors.values()])

    return write


def bounds(src) -> tuple[int, int, int]:
    """(largest input shard, largest q/k/v group, whole checkpoint) in bytes, from the headers."""
    directory = SafetensorsDirectory(src)
    g = H3Geometry.from_config(directory.config)
    group = 3 * g.inner_dim * g.hidden_size * torch.bfloat16.itemsize
    shards = [directory.shard_bytes(f) for f in directory.files]
    return max(shards), group, sum(header_bytes(h) for h in directory.headers.values())


@pytest.fixture
def sharded(full_names_model, tmp_path):
    return save_diffusers(full_names_model, tmp_path / "src", "40KB")


def convert_counted(src, dst, to, retain=False, **kwargs):
    ledger = Ledger()
    convert_directory(src, dst, to=to, open_source=counting_source(ledger, retain),
                      write_shard=counting_writer(ledger), **kwargs)
    return ledger


def test_memory_is_one_shard_plus_one_qkv_group_both_ways(sharded, tmp_path):
    legs = ((sharded, tmp_path / "native", "native"), (tmp_path / "native", tmp_path / "back", "diffusers"))
    for src, dst, to in legs:
        shard, group, total = bounds(src)
        assert total > 6 * shard  # many shards, so holding everything would show
        ledger = convert_counted(src, dst, to, qkv_layout="interleaved" if to == "native" else None)
        assert ledger.reads >= 535
        assert 0 < ledger.peak <= shard + group, (to, ledger.peak, shard, group)
        assert max(ledger.shard_bytes) <= shard + group
        assert ledger.stale_reads == 0  # nothing handed to the writer outlives its shard


def test_the_memory_harness_sees_a_converter_that_keeps_what_it_reads(sharded, tmp_path):
    shard, group, total = bounds(sharded)
    ledger = convert_counted(sharded, tmp_path / "native", "native", retain=True)
    assert ledger.peak > shard + group and ledger.peak >= total - shard


class Crash(Exception):
    pass


def test_a_crash_while_writing_leaves_no_dst(sharded, tmp_path):
    calls = []

    def write(tensors, path):
        calls.append(path)
        if len(calls) == 3:
            raise Crash("disk on fire")
        save_shard(tensors, path)

    with pytest.raises(Crash):
        convert_directory(sharded, tmp_path / "dst", to="native", write_shard=write)
    assert len(calls) == 3 and calls[0].parent.name.startswith(".dst.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, Crash])
def test_an_interrupted_read_leaves_no_dst(sharded, tmp_path, interrupt):
    reads = []

    class Failing(SafetensorsDirectory):
        def load(self, name):
            reads.append(name)
            if len(reads) == 300:
                raise interrupt()
            return super().load(name)

    with pytest.raises(interrupt):
        convert_directory(sharded, tmp_path / "dst", to="native", open_source=Failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_killed_process_leaves_no_dst(sharded, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal
        from flowlock.checkpoint import convert_directory
        from flowlock.checkpoint.directory import SafetensorsDirectory

        class Killed(SafetensorsDirectory):
            reads = 0
            def load(self, name):
                Killed.reads += 1
                if Killed.reads == 300:
                    os.kill(os.getpid(), signal.SIGKILL)
                return super().load(name)

        convert_directory({str(sharded)!r}, {str(tmp_path / "dst")!r}, to="native", open_source=Killed)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = sorted(p.name for p in tmp_path.iterdir())
    # A SIGKILL runs no cleanup: the hidden partial directory stays, DST never appears.
    assert "dst" not in left and len(left) == 2 and left[0].startswith(".dst.") and left[0].endswith(".partial")
