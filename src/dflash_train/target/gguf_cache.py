"""GGUF targets converted once into a Hugging Face folder in the user's cache.

transformers de-quantises a GGUF file on every load: the built-in SmolLM2 (98 MB, Q4_1) takes
about 25 s on two CPU cores, and its tokenizer another 6 s, paid again by every command and
every stage of the demo. The first load writes what it produced (float32 safetensors, exactly
the de-quantised numbers, plus the tokenizer and config files) to
`<cache>/gguf/<name>-<sha256 of the file>/`; later loads read that folder in about a second.

`<cache>` is `$DFLASH_TRAIN_CACHE`, else `$XDG_CACHE_HOME/dflash-train`, else
`~/.cache/dflash-train`; `DFLASH_TRAIN_CACHE=off` turns the cache off. The folder appears
atomically (written beside it, then renamed), so concurrent processes (torchrun ranks) never
read half a conversion; a cache that cannot be written is a warning, and the load reads the
GGUF as before. GGUF files over `MAX_GGUF_BYTES` are not cached (float32 is ~8x a 4-bit file).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

log = logging.getLogger(__name__)

MAX_GGUF_BYTES = 2 * 2**30
COMPLETE = "dflash-conversion.json"  # written last, inside the folder before it is renamed into place


def cache_root() -> Path | None:
    """The cache directory, or None when DFLASH_TRAIN_CACHE is 'off' (or empty / '0')."""
    configured = os.environ.get("DFLASH_TRAIN_CACHE")
    if configured is not None:
        return None if configured.strip().lower() in ("", "0", "off", "false", "no") else Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dflash-train"


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """Content digest, computed once per process for a given (path, size, mtime)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_folder(gguf: Path) -> Path | None:
    """The Hugging Face folder of `gguf` in the cache (converting it now if needed), or None
    when the cache is off, the file is too large, or the cache cannot be written."""
    root = cache_root()
    stat = gguf.stat()
    if root is None or stat.st_size > MAX_GGUF_BYTES:
        return None
    key = _sha256(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)
    folder = root / "gguf" / f"{gguf.stem}-{key[:16]}"
    if (folder / COMPLETE).is_file():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            log.info("converting %s once into %s (later loads read that folder)", gguf, folder)
            _convert(gguf, staging)
            (staging / COMPLETE).write_text(json.dumps({"gguf": str(gguf.resolve()), "sha256": key}) + "\n")
            try:
                os.replace(staging, folder)
            except OSError:
                if not (folder / COMPLETE).is_file():  # not another process that finished first
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as its own error, not OSError
        log.warning("could not cache the conversion of %s in %s (%s); reading the GGUF file instead", gguf, root, exc)
        return None
    return folder


def _convert(gguf: Path, out: Path) -> None:
    """What transformers makes of the GGUF file (float32 weights, tokenizer, config), saved.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the state dict is written
    with safetensors directly; a tensor shared by two names (tied embeddings) is kept under its
    first name, and from_pretrained ties the other to it again."""
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[name] = tensor.contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    del model, state
    AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs).save_pretrained(out)
