"""How ssd/kernels/build.py finds a kernel's text: the .cpp and the headers it includes, all of
which name its build folder (no compiling here)."""
import pytest
from torch.utils import cpp_extension

from ssd.kernels import build
from ssd.kernels.build import CppKernel

pytestmark = pytest.mark.usefixtures("own_kernels")


@pytest.fixture
def csrc(tmp_path, monkeypatch):
    """A csrc/ of its own: k.cpp includes a.h, which includes sub/b.h, which includes c.h
    beside it; other.h is included by nobody."""
    d = tmp_path / "csrc"
    (d / "sub").mkdir(parents=True)
    (d / "k.cpp").write_text('#include <vector>\n#include "a.h"\nint k() { return a(); }\n')
    (d / "a.h").write_text('#pragma once\n  #  include "sub/b.h"\nstatic int a() { return b() + 1; }\n')
    (d / "sub" / "b.h").write_text('#pragma once\n#include "c.h"\nstatic int b() { return C; }\n')
    (d / "sub" / "c.h").write_text("#define C 1\n")
    (d / "other.h").write_text("#define OTHER 1\n")
    monkeypatch.setattr(build, "SOURCES", d)
    monkeypatch.setenv("SSD_HOME", str(tmp_path / "home"))
    return d


def test_sources_follow_local_includes(csrc):
    assert list(CppKernel("k").sources) == ["k.cpp", "a.h", "sub/b.h", "sub/c.h"]


@pytest.mark.parametrize("edited", ["k.cpp", "a.h", "sub/b.h", "sub/c.h"])
def test_editing_any_included_file_changes_the_build_folder(csrc, edited):
    before = CppKernel("k").build_dir("portable")
    assert CppKernel("k").build_dir("portable") == before
    (csrc / "other.h").write_text("#define OTHER 2\n")  # not included: same folder
    assert CppKernel("k").build_dir("portable") == before
    path = csrc / edited
    path.write_text(path.read_text() + "// edited\n")
    assert CppKernel("k").build_dir("portable") != before


def test_the_build_compiles_the_hashed_copies(csrc, monkeypatch):
    """The headers are copied beside the source in the build folder, so the compiler reads
    the texts the folder's name was hashed from."""
    seen = {}

    def load(name, sources, **kwargs):
        seen["sources"] = sources
        seen["include"] = kwargs.get("extra_include_paths")

    monkeypatch.setattr(cpp_extension, "load", load)
    kernel = CppKernel("k")
    d = kernel.build_dir("portable")
    kernel._build("portable")
    assert seen == {"sources": [str(d / "k.cpp")], "include": None}
    for path, text in kernel.sources.items():
        assert (d / path).read_text() == text
    assert not (d / "other.h").exists()


def test_the_kernels_share_their_isa_header():
    """linear and linear_int8 include v8.h and through it isa.h; attention and quant isa.h;
    every kernel library.h (its namespace)."""
    for name in ("linear", "linear_int8"):
        assert list(CppKernel(name).sources) == [f"{name}.cpp", "library.h", "v8.h", "isa.h"]
    for name in ("attention", "quant"):
        assert list(CppKernel(name).sources) == [f"{name}.cpp", "library.h", "isa.h"]
    for name in ("fused", "decoder"):
        assert "library.h" in CppKernel(name).sources


def test_a_build_leaves_the_next_kernels_flags_alone(csrc, monkeypatch):
    """torch's load() appends its libraries to the flag lists it is given, in place: a list
    the kernels share would change every later kernel's flags, so its folder (on a fresh
    machine, each kernel the process loaded after the first compiled a second time)."""
    def load(name, sources, extra_cflags, extra_ldflags, **kwargs):  # as torch's does
        extra_ldflags += ["-L/torch/lib", "-lc10"]
        extra_cflags += ["-I/torch/include"]

    monkeypatch.setattr(cpp_extension, "load", load)
    first, second = CppKernel("k"), CppKernel("k")
    before = (first.flags("portable"), second.build_dir("portable"))
    first._build("portable")
    assert (first.flags("portable"), second.build_dir("portable")) == before
