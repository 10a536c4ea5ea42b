"""Find a checkpoint: a local folder, or a Hugging Face repo id resolved through the standard
HF cache.

`resolve_model_path("mlx-community/Qwen3.6-35B-A3B-4bit")` downloads only the files lily reads
(`ALLOW_PATTERNS`: config, safetensors shards and index, tokenizer, chat template, generation
config; no vision or PyTorch weights), with huggingface_hub's progress bars, into the cache
everyone shares (`HF_HOME` / `HF_HUB_CACHE`). Offline (`HF_HUB_OFFLINE=1`, `offline=True`) or
when the Hub cannot be reached, the cached snapshot is used; if there is none, the error says
so and names the cache folder searched.

Ctrl-C during a download. huggingface_hub downloads the files on a thread pool and, when the
caller is interrupted, waits for the files in flight to finish before the KeyboardInterrupt
gets through: on a 20 GB shard that is minutes of a terminal that ignores Ctrl-C. So the
download runs on a thread of its own, the caller waits for it interruptibly, and an interrupt
raises at once; the download threads stop at their next progress update (huggingface_hub
updates the bar once per 10 MB chunk received), through a progress-bar class whose update
raises once the download is cancelled. A file cut off that way stays huggingface_hub's
`blobs/*.incomplete` (resumed by the next download), never a file in the snapshot, so nothing
half-written is taken for a checkpoint.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["ALLOW_PATTERNS", "resolve_model_path"]

ALLOW_PATTERNS = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
]


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _looks_like_path(s: str) -> bool:
    # Repo ids are "name" or "owner/name"; anything else with a separator is a path.
    return s.startswith(("/", ".", "~")) or s.count("/") > 1 or "\\" in s


def _check_snapshot(folder: Path, what: str) -> Path:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{what}: {folder} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"{what}: {folder} has no *.safetensors weights")
    return folder


class _Cancelled(Exception):
    """Raised in huggingface_hub's download threads once the caller was interrupted."""


def _interruptible_snapshot_download(repo_id: str, **kwargs) -> str:
    """`snapshot_download` on a thread of its own; Ctrl-C in the caller raises at once and
    stops the download threads at their next progress update (see the module docstring)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import tqdm as hf_tqdm

    cancel = threading.Event()

    class Bar(hf_tqdm):  # huggingface_hub's own bar: same display, same disable switches
        def update(self, n=1):
            if cancel.is_set():
                raise _Cancelled("download cancelled by the caller")
            return super().update(n)

    out: dict = {}

    def run() -> None:
        try:
            out["path"] = snapshot_download(repo_id, tqdm_class=Bar, **kwargs)
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    worker = threading.Thread(target=run, name=f"lily-download-{repo_id}", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)  # a timed wait: a signal interrupts it
    except BaseException:
        cancel.set()
        raise
    if "error" in out:
        raise out["error"]
    return out["path"]


def resolve_model_path(
    path_or_repo_id: str | os.PathLike,
    revision: str | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    offline: bool | None = None,
    token: str | bool | None = None,
) -> Path:
    """The local folder holding the checkpoint (downloading it first if needed)."""
    local = Path(path_or_repo_id).expanduser()
    if local.is_dir():
        return _check_snapshot(local.resolve(), str(path_or_repo_id))
    name = str(path_or_repo_id)
    if _looks_like_path(name) or local.exists():
        raise FileNotFoundError(f"model folder not found: {name}")

    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as e:
        raise ValueError(f"{name!r} is neither a local folder nor a valid Hugging Face repo id ({e})") from None

    if offline is None:
        offline = constants.HF_HUB_OFFLINE or _truthy(os.environ.get("HF_HUB_OFFLINE"))
    where = Path(cache_dir) if cache_dir else Path(constants.HF_HUB_CACHE)
    kwargs = dict(revision=revision, cache_dir=cache_dir, allow_patterns=ALLOW_PATTERNS, token=token)
    label = f"{name}" + (f"@{revision}" if revision else "")

    if not offline:
        try:
            return _check_snapshot(Path(_interruptible_snapshot_download(name, **kwargs)), label)
        except (RepositoryNotFoundError, GatedRepoError) as e:
            raise FileNotFoundError(
                f"{label}: no such model on the Hugging Face Hub, or it needs a token you lack ({type(e).__name__})"
            ) from None
        except RevisionNotFoundError:
            raise FileNotFoundError(f"{label}: the repo has no revision {revision!r}") from None
        except (OfflineModeIsEnabled, LocalEntryNotFoundError, OSError):
            pass  # the Hub is unreachable: fall back to the cache below
        except Exception as e:  # network stacks raise their own types (httpx, requests)
            if "connect" not in type(e).__name__.lower() and "timeout" not in type(e).__name__.lower():
                raise
    try:
        folder = snapshot_download(name, local_files_only=True, **kwargs)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, FileNotFoundError):
        mode = "offline mode is on" if offline else "the Hugging Face Hub could not be reached"
        raise FileNotFoundError(
            f"{label} is not a local folder and is not in the Hugging Face cache ({where}); {mode}"
        ) from None
    return _check_snapshot(Path(folder), f"{label} (cached)")
