"""The default corpus: the running interpreter's standard library ``.py`` files, tokenized once.

It needs no download, so a fresh checkout can train end to end. The prepared shards are cached
under ``<cache_dir>/stdlib-<tokenizer fingerprint>/``.
"""

from __future__ import annotations

import fcntl
import os
import sysconfig

from titanlab.data.prepare import METADATA_FILE, prepare_data
from titanlab.data.tokenizer import Tokenizer

_EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")


def default_cache_dir() -> str:
    """``$TITANLAB_CACHE`` if set, else ``~/.cache/titanlab``."""
    return os.environ.get("TITANLAB_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "titanlab"
    )


def default_corpus_files() -> list[str]:
    """Sorted absolute paths of every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``.

    ``site-packages``, ``dist-packages`` and ``__pycache__`` directories are left out.

    Raises:
        ValueError: the standard library directory holds no ``.py`` files.
    """
    root = sysconfig.get_paths()["stdlib"]
    files: list[str] = []
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        files.extend(os.path.join(parent, n) for n in names if n.endswith(".py"))
    if not files:
        raise ValueError(f"no .py files under the stdlib dir {root!r}; pass your own data instead")
    return sorted(os.path.abspath(f) for f in files)


def ensure_default_corpus(cache_dir: str, tokenizer_path: str, workers: int = 1) -> str:
    """Prepare the default corpus with ``tokenizer_path`` unless already cached; return its dir.

    Safe to call from several processes at once: the first one prepares the data while holding an
    exclusive ``fcntl.flock`` on ``<cache_dir>/stdlib-<fingerprint>.lock``; the others block on
    the lock and then reuse the result. An interrupted preparation resumes per shard.

    Args:
        cache_dir: parent directory of the cache (see :func:`default_cache_dir`).
        tokenizer_path: a Llama 3 format ``tokenizer.model``.
        workers: tokenizer processes used when the data has to be prepared.

    Returns:
        ``<cache_dir>/stdlib-<fingerprint>``, a directory holding ``metadata.json`` and shards.

    Raises:
        FileNotFoundError / ValueError: as :class:`Tokenizer` and :func:`prepare_data`.
    """
    fingerprint = Tokenizer(tokenizer_path).fingerprint
    out_dir = os.path.join(cache_dir, f"stdlib-{fingerprint}")
    meta_path = os.path.join(out_dir, METADATA_FILE)
    if os.path.isfile(meta_path):
        return out_dir
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, f"stdlib-{fingerprint}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not os.path.isfile(meta_path):
                prepare_data(
                    default_corpus_files(),
                    out_dir,
                    tokenizer_path,
                    workers=workers,
                    shard_size_mb=4.0,
                )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out_dir
