"""Models named by Hugging Face hub id (docs/models.md, "Hub ids"): `org/name`, `org/name@REV`,
`org/name:TAG` (a GGUF repository's file by its quantisation tag, or `:FILE.gguf`), fetched
with huggingface_hub into its own cache ($HF_HUB_CACHE, else $HF_HOME/hub), read from that
cache alone when $HF_HUB_OFFLINE is set or the hub cannot be reached."""
import os
import re
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

from ssd.errors import ModelFileError, ModelNotFoundError

# org/name, then @revision (a branch, tag or commit), then :tag or :file.gguf; a name is
# what the hub allows (letters, digits, '-', '_', '.').
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)"
                    r"(?:@(?P<revision>[\w./-]+))?(?::(?P<tag>[\w.-]+))?")
DEFAULT_TAG = "Q4_K_M"  # a GGUF repository's file when it holds several and no tag is given (as llama.cpp's -hf)
# A safetensors repository's top-level files a model folder needs, beside its weights.
FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "merges.txt", "chat_template*")
_fetched: dict[tuple[str, Path, bool], Path] = {}  # one resolution a process: the same id names the same files


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str | None
    tag: str | None

    def __str__(self) -> str:
        return self.repo + (f"@{self.revision}" if self.revision else "") + (f":{self.tag}" if self.tag else "")


def parse(spec: str) -> HubRef | None:
    """The hub id `spec` is, or None: a path (it starts with /, . or ~, or is a .gguf name
    without a tag) or anything else that is not org/name[@REV][:TAG]."""
    m = HUB_ID.fullmatch(spec)
    if m is None or (spec.lower().endswith(".gguf") and m["tag"] is None):
        return None
    return HubRef(m["repo"], m["revision"], m["tag"])


def cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it, read now (its constants are read at import)."""
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or Path(home) / "hub"
    return Path(hub).expanduser()


def offline() -> bool:
    """$HF_HUB_OFFLINE (or transformers' $TRANSFORMERS_OFFLINE), read now as for cache_dir."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ("1", "ON", "YES", "TRUE")


def fetch(ref: HubRef, force: bool = False) -> Path:
    """The model folder of a safetensors repository, or the one .gguf file of a GGUF one,
    downloaded unless cached (again if `force`)."""
    cache, no_hub = cache_dir(), offline()
    key = (str(ref), cache, no_hub)
    if key not in _fetched or force:
        _fetched[key] = _fetch(ref, cache, no_hub, force)
    return _fetched[key]


def _fetch(ref: HubRef, cache: Path, no_hub: bool, force: bool) -> Path:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    files, why = None, "HF_HUB_OFFLINE is set"
    if not no_hub:
        try:
            files = HfApi().list_repo_files(ref.repo, revision=ref.revision)
        except RevisionNotFoundError:
            raise ModelNotFoundError(f"{ref.repo} on the Hugging Face hub has no revision {ref.revision!r}") from None
        except RepositoryNotFoundError:  # also a gated or private repository without a token that may read it
            raise ModelNotFoundError(
                f"no model {ref.repo!r} on the Hugging Face hub, nor a folder or file of that name here (a private "
                f"or gated repository needs HF_TOKEN set to a token that may read it)") from None
        except Exception as e:  # no answer (no network, a proxy, the hub down): the cache may hold it
            why = f"the hub could not be reached ({type(e).__name__}: {e})"
    from_cache = files is None
    if from_cache:
        files = _cached_files(ref, cache)
        if files is None:
            raise ModelNotFoundError(
                f"model {str(ref)!r} is not in the Hugging Face cache ({cache}) and {why}; nor is it a folder or "
                f"file here. {'Unset HF_HUB_OFFLINE' if no_hub else 'Connect'} to download it, or pass a model "
                f"folder or .gguf file by its path instead (LLM('/path/to/model'), --model ./model.gguf).")
    pick = _pick(ref, files, from_cache)
    kw = dict(repo_id=ref.repo, revision=ref.revision, cache_dir=cache, local_files_only=from_cache,
              force_download=force and not from_cache)
    try:
        if isinstance(pick, str):
            return Path(hf_hub_download(filename=pick, **kw))
        return Path(snapshot_download(allow_patterns=pick, **kw))
    except Exception as e:  # a download cut off, a full disk: one line, not the library's traceback
        raise ModelFileError(f"{ref}: fetching {pick} from the Hugging Face hub failed: {type(e).__name__}: {e}") from e


def _cached_files(ref: HubRef, cache: Path) -> list[str] | None:
    """The files of `ref`'s snapshot in the cache (the layout of huggingface_hub's cache guide:
    models--org--name/refs/<branch> holds a commit, snapshots/<commit>/ its files), or None."""
    repo = cache / f"models--{ref.repo.replace('/', '--')}"
    refs = repo / "refs" / (ref.revision or "main")
    snapshot = repo / "snapshots" / (refs.read_text().strip() if refs.is_file() else ref.revision or "main")
    if not snapshot.is_dir():
        return None
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _pick(ref: HubRef, files: list[str], from_cache: bool) -> str | list[str]:
    """What to fetch of a repository holding `files` (those in the cache if `from_cache`): one
    .gguf file (a tag given, or no safetensors), else a model folder's files (config,
    tokenizer, safetensors and their index, or an EAGLE-3 head's pytorch_model.bin)."""
    top = [f for f in files if "/" not in f]
    weights = ([f for f in top if f.endswith((".safetensors", ".safetensors.index.json"))]
               or [f for f in top if f == "pytorch_model.bin"])
    if ref.tag is None and weights and "config.json" in top:
        return [f for f in top if any(fnmatch(f, p) for p in FOLDER_FILES)] + weights
    ggufs = [f for f in files if f.lower().endswith(".gguf") and not f.rpartition("/")[2].startswith("mmproj")]
    held = "the cached snapshot holds" if from_cache else "the repository holds"
    if not ggufs:
        raise ModelNotFoundError(f"{ref}: {held} neither config.json with safetensors nor .gguf files "
                                 f"(its files: {', '.join(files[:30])})")
    if ref.tag is None and len(ggufs) == 1:
        return ggufs[0]
    tag = ref.tag or DEFAULT_TAG
    if tag.lower().endswith(".gguf"):
        found = [f for f in ggufs if tag.lower() in (f.lower(), f.rpartition("/")[2].lower())]
    else:  # the tag as a whole word: Q4_K matches neither Q4_K_M nor Q4_K_S, F16 not BF16
        word = re.compile(rf"(?<![a-z0-9]){re.escape(tag)}(?![a-z0-9_])", re.IGNORECASE)
        found = [f for f in ggufs if word.search(f)]
    if len(found) != 1:
        asked = f"tag {tag!r}" if ref.tag else f"no tag, and the default {DEFAULT_TAG!r}"
        raise ModelNotFoundError(
            f"{ref.repo}: {asked} matches {'none' if not found else 'several'} of its .gguf files; name one as "
            f"{ref.repo}:TAG or {ref.repo}:FILE.gguf. {held.capitalize()}: {', '.join(found or ggufs)}")
    return found[0]
