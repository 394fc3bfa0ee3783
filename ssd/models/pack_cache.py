"""A GGUF model's matrices as the CPU kernel holds them, kept on disk after the first load.

Repacking every matrix into the kernel's layout (csrc/quant.cpp) takes seconds of an 8B
model's load, each time (docs/decision-log.md). The first load of a model whose packed
matrices reach MIN_BYTES (256 MiB) writes them to one file beside its prepared folder
(packed-<key>.bin, about the GGUF file's size) with an index (packed-<key>.json, written
last, so a file cut short is never used); later loads read that file into memory instead
(at the page cache's or the disk's pace). The key covers the GGUF
file (path, size, modification time), the packed layout (the kernel's source) and the load's
options (a draft's requantisation, a reduced head's rows), so a change to any of them makes
a new file. `SSD_PACK_CACHE=0` turns it off.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from gguf import GGMLQuantizationType as GGML

from ssd.kernels import quant_cpu

MIN_BYTES = 256 << 20  # smaller models repack in a third of a second or less
ALIGN = 4096
_LAYOUT_SOURCES = (Path(quant_cpu.__file__).parent / "csrc" / "quant.cpp",)


def enabled() -> bool:
    return os.environ.get("SSD_PACK_CACHE", "1") != "0"


@dataclass
class _Entry:
    offset: int
    nbytes: int
    qtype: int
    rows: int
    cols: int


class PackCache:
    """Packed matrices of one load, by name: read from the file where it holds them, else
    made and, at `save`, written for the next load."""

    def __init__(self, gguf: Path, options: str):
        self.folder = gguf.parent
        real = gguf.resolve()
        st = real.stat()
        h = hashlib.blake2b(digest_size=8)
        for part in (str(real), str(st.st_size), str(st.st_mtime_ns), options):
            h.update(part.encode() + b"\0")
        for src in _LAYOUT_SOURCES:
            h.update(src.read_bytes())
        self.options = options
        self.folder_link = gguf.name
        self.bin = self.folder / f"packed-{h.hexdigest()}.bin"
        self.index = self.bin.with_suffix(".json")
        self.entries: dict[str, _Entry] = {}
        self.map: torch.Tensor | None = None
        self.made: dict[str, quant_cpu.QuantMatrix] = {}
        self.hits = 0
        if enabled():
            self._open()

    def _open(self) -> None:
        try:
            meta = json.loads(self.index.read_text())
            if meta["bytes"] != self.bin.stat().st_size:
                return
            entries = {k: _Entry(*v) for k, v in meta["entries"].items()}
            self.map = _read(self.bin, meta["bytes"])
            self.entries = entries
        except (OSError, ValueError, KeyError, TypeError):
            self.entries, self.map = {}, None

    def matrix(self, name: str, make: Callable[[], quant_cpu.QuantMatrix]) -> quant_cpu.QuantMatrix:
        """The packed matrix `name`: a view of the file's copy, or make() (remembered for `save`)."""
        e = self.entries.get(name)
        if e is not None and self.map is not None:
            self.hits += 1
            return quant_cpu.QuantMatrix(GGML(e.qtype), e.rows, e.cols, self.map[e.offset:e.offset + e.nbytes])
        m = self.made[name] = make()
        return m

    def save(self) -> None:
        """Write what this load made, if it made everything (no file held any of it) and enough
        of it to be worth a file, in a thread of its own: writing 5 GB took 9.6 s on the
        development machine (the disk's pace), which the first load need not wait for. A
        failure to write (a full disk, a read-only store) costs only the next load's
        repacking: said on stderr, never raised."""
        total = sum(m.nbytes for m in self.made.values())
        if not enabled() or self.hits or total < MIN_BYTES or self.bin in _writing:
            return
        _writing.add(self.bin)
        writer = threading.Thread(target=self._write, name="ssd-pack-cache", args=(dict(self.made),))
        writer.start()  # not a daemon: the interpreter waits for it at exit rather than leave half a file
        _writers.append(writer)

    def _write(self, made: dict[str, quant_cpu.QuantMatrix]) -> None:
        for old in self.folder.glob(".packed-*"):  # what a process killed while writing left
            pid = old.suffix[1:]
            if pid.isdigit() and not _alive(int(pid)):
                old.unlink(missing_ok=True)
        tmp_bin = self.bin.with_name(f".{self.bin.name}.{os.getpid()}")
        tmp_index = self.index.with_name(f".{self.index.name}.{os.getpid()}")
        try:
            entries, offset = {}, 0
            with open(tmp_bin, "wb") as f:
                for name, m in made.items():
                    offset = -(-offset // ALIGN) * ALIGN
                    f.seek(offset)
                    f.write(memoryview(m.packed.numpy()))
                    entries[name] = [offset, m.nbytes, int(m.qtype), m.rows, m.cols]
                    offset += m.nbytes
                f.truncate(offset)
            tmp_index.write_text(json.dumps({"bytes": offset, "options": self.options, "entries": entries}))
            os.replace(tmp_bin, self.bin)
            os.replace(tmp_index, self.index)  # last: the index names a whole file
            with contextlib.suppress(OSError):  # tidying only: the file is kept either way
                self._drop_stale()
                self._drop_orphans()
        except OSError as e:
            print(f"ssd: could not keep the packed weights in {self.folder} ({e}); the next load repacks them",
                  file=sys.stderr)
            for p in (tmp_bin, tmp_index):
                p.unlink(missing_ok=True)
        finally:
            _writing.discard(self.bin)

    def _drop_stale(self) -> None:
        """Remove the files of this load's options made for an older GGUF file or layout (only
        the newest can ever be read again)."""
        for index in self.folder.glob("packed-*.json"):
            if index == self.index:
                continue
            try:
                if json.loads(index.read_text()).get("options") != self.options:
                    continue
            except (OSError, ValueError, AttributeError):
                pass
            index.unlink(missing_ok=True)
            index.with_suffix(".bin").unlink(missing_ok=True)

    def _drop_orphans(self) -> None:
        """Remove the files kept beside folders (this one's siblings: the store's prepared
        folders) whose GGUF link points nowhere now: a model file given by path and since
        deleted leaves nothing behind but its small prepared folder."""
        for folder in self.folder.parent.iterdir():  # (glob skips a link that points nowhere)
            link = folder / self.folder_link
            if link.is_symlink() and not link.exists():
                for old in folder.glob("packed-*"):
                    old.unlink(missing_ok=True)


def _read(path: Path, nbytes: int) -> torch.Tensor:
    """The file into memory of this process, read by a few threads (from the page cache this
    is memcpy's pace). Not a memory map: mapped pages are the page cache's, which the kernel
    drops under pressure, and a model that nearly fills RAM (a 17 GB MoE file on 24 GB) then
    decoded at disk speed while other files held the cache; this memory stays resident, as
    repacked matrices do. (Asking for transparent huge pages cost a 12 s compaction stall
    once, on a host whose memory a 19 GB process had just left fragmented; their gain on
    streaming was within noise.)"""
    mem = mmap.mmap(-1, max(nbytes, 1))
    buf = memoryview(mem)
    parts = max(1, min(torch.get_num_threads(), 8))
    step = -(-nbytes // parts // ALIGN) * ALIGN
    fd = os.open(path, os.O_RDONLY)
    errors: list[Exception] = []

    def part(lo: int) -> None:
        try:
            hi = min(nbytes, lo + step)
            while lo < hi:
                n = os.preadv(fd, [buf[lo:hi]], lo)
                if n <= 0:
                    raise OSError(f"{path} ends at byte {lo} of {nbytes}")
                lo += n
        except OSError as e:
            errors.append(e)
    try:
        threads = [threading.Thread(target=part, args=(lo,)) for lo in range(0, nbytes, step)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return torch.frombuffer(mem, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)


_writers: list[threading.Thread] = []
_writing: set[Path] = set()  # files this process is writing (a second load meanwhile repacks, writes none)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def writing() -> bool:
    """Whether this process is still writing a cache file."""
    return any(t.is_alive() for t in _writers)


def wait() -> None:
    """Until every cache file this process started writing is written (for tests, benchmarks)."""
    while _writers:
        _writers.pop().join()
