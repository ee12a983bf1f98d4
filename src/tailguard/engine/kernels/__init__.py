"""tailguard's CPU kernels (tg_kernels.c): products on GGUF's quantized blocks and a whole decode step in one call.

The C source is compiled with the machine's gcc (``-O3 -march=native -fopenmp``) at install time
(``python -m tailguard.engine.kernels``) or on first use, into a cache keyed by the source, the compiler and the CPU's
instruction set, and loaded with ctypes, which releases the GIL during each call, so the HTTP event loop keeps running
while a step computes. Arrays are numpy's, or torch's CPU tensors (what comes back is of the caller's kind): the lean
runner (engine/native_runner.py) serves without importing torch.

Parallel loops run on the kernels' own thread pool, whose threads sleep soon after they run out of work; its thread
count, polling time and the choice of OpenMP's pool instead are read from the environment when the library loads
(engine/threads.py). OpenMP's pool (``libgomp.so.1``, which torch also loads: whichever loads first, the other reuses
it) serves the loops only with ``TAILGUARD_THREAD_POOL=openmp``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tailguard.engine import threads as thread_settings
from tailguard.engine.model_store import cache_dir

SOURCE = Path(__file__).with_name("tg_kernels.c")
ABI_VERSION = 11
THREAD_POOLS = {"tailguard": 0, "openmp": 1}  # tg_kernels.c's TG_POOL_*

# ggml type ids (GGUF's own numbering) of the formats the kernels read directly, and Q4_1R: Q4_1 repacked at load
# (each row's nibbles together, then its scales and mins as float32), which the single-row kernel reads faster.
# Q4_1X / Q8_0X: the same blocks interleaved by groups of 16 rows for the int8-activation (AVX-512 VNNI) products
# (tg_kernels.c describes the layout).
F32, F16, Q4_0, Q4_1, Q8_0, Q4_1R, Q4_1X, Q8_0X = 0, 1, 2, 3, 8, 100, 101, 102
NATIVE_FORMATS = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_1R: "Q4_1R", Q4_1X: "Q4_1X",
                  Q8_0X: "Q8_0X"}
INTERLEAVED_FORMATS = (Q4_1X, Q8_0X)
GROUP_ROWS = 16  # rows per interleaved group
# Activations of the products, read when matrices load (kernels.activation_passes): 2 (the default where the build
# has AVX-512 VNNI) int8 plus the int8 rounding residual, ~16-bit activations, within 0.02% of float32's perplexity
# on SmolLM2; 1 int8 alone, as llama.cpp, which fails the fidelity gate on SmolLM2 (tests/engine/test_weight_formats.py's
# slices: perplexity +3.1% on English, logits off by up to 14% of their scale), an opt-in speed option; 0 float32
# activations (the exact products, Q4_1R layout).
INT8_ACTIVATIONS_ENV = "TAILGUARD_INT8_ACTIVATIONS"
# "0": prompt rows of the C step through the block kernels, as decodes, instead of the matrix units (AMX, bfloat16)
PROMPT_BF16_ENV = "TAILGUARD_PROMPT_BF16"
DEFAULT_ACTIVATION_PASSES = 2
# KV cache formats the decode step reads (tg_kernels.c's TG_KV_*), by dtype name: int8 rows with a float16 scale each.
KV_FORMATS = {"float32": 0, "float16": 1, "int8": 2}

Array = Any  # a numpy array, or a torch CPU tensor (a caller that has torch loaded)


def _is_torch(a: Array) -> bool:
    return type(a).__module__.startswith("torch")


def _np(a: Array) -> np.ndarray:
    """The same memory as a numpy array (a torch CPU tensor is viewed, never copied)."""
    if _is_torch(a):
        if a.device.type != "cpu":
            raise ValueError("tailguard's kernels read CPU memory only")
        return a.detach().numpy()
    return a


def _cpu_array(a: Array) -> np.ndarray | None:
    """``a`` as a numpy array over the same memory, or None where it is not one (a CUDA tensor, another object)."""
    try:
        return _np(a)
    except (ValueError, TypeError, RuntimeError):
        return None


def _like(out: np.ndarray, template: Array) -> Array:
    """``out`` as the caller's kind of array (torch only where the caller's array is torch's: torch is loaded)."""
    return sys.modules["torch"].from_numpy(out) if _is_torch(template) else out


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def dtype_name(x: Any) -> str:
    """'float32', 'float16', 'int8', ... for a name, a numpy or torch dtype, or an array of either kind."""
    if isinstance(x, str):
        return x
    if isinstance(x, type):  # np.int8 and the like
        return np.dtype(x).name
    return str(getattr(x, "dtype", x)).removeprefix("torch.")


class KernelBuildError(RuntimeError):
    pass


def _cpu_key() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _library_path() -> Path:
    cc = os.environ.get("CC", "gcc")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    except OSError as exc:
        raise KernelBuildError(f"no C compiler ({cc}): tailguard's native kernels need gcc") from exc
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode() + _cpu_key().encode()).hexdigest()[:16]
    return cache_dir().parent / "kernels" / f"tg_kernels-{digest}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels for this machine (once; cached). Returns the shared library's path."""
    path = _library_path()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise KernelBuildError(f"no C compiler ({cc}) on PATH: tailguard's native kernels need gcc")
    partial = path.with_suffix(f".{os.getpid()}.partial")
    cmd = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(partial), str(SOURCE), "-lm"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise KernelBuildError(f"compiling {SOURCE.name} failed:\n{' '.join(cmd)}\n{result.stderr[-4000:]}")
    if verbose:
        print(" ".join(cmd))
    partial.replace(path)
    return path


_lib: ctypes.CDLL | None = None
_lock = threading.Lock()
_settings: thread_settings.ThreadSettings | None = None  # what the loaded library was configured with


def lib() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            handle = ctypes.CDLL(str(build()))
            if handle.tg_abi_version() != ABI_VERSION:
                raise KernelBuildError("stale kernel library: ABI version mismatch")
            p, i = ctypes.c_void_p, ctypes.c_int
            handle.tg_linear.argtypes = [p, i, i, p, i, i, p, i]
            handle.tg_dequant.argtypes = [p, i, i, i, p]
            handle.tg_embed.argtypes = [p, i, p, i, i, i, p]
            handle.tg_simd.restype = ctypes.c_char_p
            handle.tg_int8_dot.restype = ctypes.c_int
            handle.tg_set_activation_passes.argtypes = [i]
            handle.tg_set_generic_attention.argtypes = [i]
            handle.tg_decode.argtypes = [p, p, i, p, p, p, p, i, p, i, p, p, i]
            handle.tg_pack_bf16.argtypes = [p, i, i, i, p]
            handle.tg_linear_bf16.argtypes = [p, i, i, p, i, p, i]
            handle.tg_amx_available.restype = i
            handle.tg_tile_unit.restype = i
            handle.tg_profile.argtypes = [i]
            handle.tg_profile_read.argtypes = [p]
            handle.tg_set_num_threads.argtypes = [i]
            handle.tg_num_threads.restype = i
            handle.tg_set_spin_ns.argtypes = [ctypes.c_int64]
            handle.tg_set_thread_pool.argtypes = [i]
            handle.tg_set_thread_pool.restype = i
            handle.tg_thread_stats.argtypes = [p]
            handle.tg_pool_stress.argtypes = [ctypes.c_int64, i, ctypes.c_int64]
            handle.tg_pool_stress.restype = ctypes.c_int64
            _configure(handle)
            _lib = handle
        return _lib


def load_build(source: Path) -> ctypes.CDLL:
    """The kernels built from another source file (same ABI), loaded beside the active library, which stays active:
    benchmarks compare two builds in one process by setting ``_lib`` to either, so a noisy host slows both alike."""
    global SOURCE, _lib
    saved_source, saved_lib = SOURCE, _lib
    try:
        SOURCE, _lib = Path(source), None
        return lib()
    finally:
        SOURCE, _lib = saved_source, saved_lib


def _configure(handle: ctypes.CDLL) -> None:
    """Apply the environment's thread settings (engine/threads.py) to a freshly loaded library."""
    global _settings
    settings = thread_settings.resolve()
    handle.tg_set_thread_pool(THREAD_POOLS[settings.pool])
    handle.tg_set_spin_ns(settings.spin_us * 1000)
    if settings.pool == "tailguard":
        # OpenMP's pool keeps its own defaults (OMP_NUM_THREADS, or a thread a CPU), as it did before
        handle.tg_set_num_threads(settings.threads)
    _settings = settings


def available() -> bool:
    """True when the kernels are (or can be) built here: x86-64 or other CPUs with gcc."""
    try:
        lib()
        return True
    except (KernelBuildError, OSError):
        return False


def simd() -> str:
    return lib().tg_simd().decode()


def activation_passes() -> int:
    """``TAILGUARD_INT8_ACTIVATIONS``: 0 (float32 activations), 1 (int8) or 2 (int8 plus its rounding residual in
    int8: ~16-bit activations, twice the integer work; the default); 0 where this build has no VNNI products."""
    value = os.environ.get(INT8_ACTIVATIONS_ENV, str(DEFAULT_ACTIVATION_PASSES)).strip()
    if value not in ("0", "1", "2"):
        raise ValueError(f"{INT8_ACTIVATIONS_ENV} must be 0, 1 or 2, not {value!r}")
    return int(value) if lib().tg_int8_dot() else 0


def set_activation_passes(passes: int) -> None:
    """How many int8 passes the interleaved products make from now on, process-wide (1 or 2): loading a model sets
    it from TAILGUARD_INT8_ACTIVATIONS, so models loaded with different settings in one process share the last."""
    if passes not in (1, 2):
        raise ValueError("activation passes are 1 or 2")
    lib().tg_set_activation_passes(passes)


def set_generic_attention(on: bool) -> None:
    """Decode attention on the generic path (True) or, where the build and the head shape allow, the AVX-512 one
    that scores 16 positions at a time (False, the default). For comparing the two in one process."""
    lib().tg_set_generic_attention(1 if on else 0)


_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_1R: 24, Q4_1X: 24, Q8_0X: 36}  # bytes per block of 32 weights


def row_bytes(fmt: int, k: int) -> int:
    """Bytes of one row of ``k`` weights in ``fmt`` (what tg_kernels.c's row_bytes computes)."""
    if fmt == F32:
        return 4 * k
    if fmt == F16:
        return 2 * k
    return k // 32 * _BLOCK_BYTES[fmt]


def set_num_threads(n: int) -> None:
    """Threads of the parallel loops from now on, the calling thread included: the kernels' own pool's
    (process-wide) and OpenMP's (a per-thread setting: the native runner applies it on the thread that steps)."""
    if n < 1:
        raise ValueError("threads must be >= 1")
    lib().tg_set_num_threads(n)


def num_threads() -> int:
    """Threads of the loops the calling thread starts (OpenMP's count for this thread under the OpenMP pool)."""
    return int(lib().tg_num_threads())


def set_thread_pool(pool: str) -> None:
    """``tailguard`` (the kernels' own pool) or ``openmp`` (libgomp's) for the loops from now on, process-wide: for
    comparing the two in one process (benchmarks, tests); TAILGUARD_THREAD_POOL sets it at load."""
    if pool not in THREAD_POOLS:
        raise ValueError(f"thread pool must be one of {', '.join(THREAD_POOLS)}, not {pool!r}")
    lib().tg_set_thread_pool(THREAD_POOLS[pool])


def set_spin_us(us: int) -> None:
    """How long the own pool's idle threads poll before they sleep, from now on (TAILGUARD_SPIN_US sets it at load)."""
    if us < 0:
        raise ValueError("spin time must be >= 0")
    lib().tg_set_spin_ns(int(us) * 1000)


def thread_settings_loaded() -> thread_settings.ThreadSettings:
    """The settings the library applied when it loaded (engine/threads.py)."""
    lib()
    assert _settings is not None
    return _settings


THREAD_STATS = ("loops", "worker_sleeps", "caller_sleeps", "loops_alone", "contention", "workers")


def thread_stats() -> dict[str, int]:
    """The own pool's counters since the library loaded: loops it ran, sleeps of its workers and of callers waiting
    for them, loops run on the calling thread alone because another had the pool, times a pool thread found itself
    preempted (polling off for a while); and its workers now."""
    out = (ctypes.c_int64 * len(THREAD_STATS))()
    lib().tg_thread_stats(out)
    return dict(zip(THREAD_STATS, (int(v) for v in out)))


def pool_stress(loops: int, max_items: int = 64, work: int = 0) -> int:
    """Run ``loops`` parallel loops of 1..``max_items`` items on the thread pool (``work``: pause instructions per
    item), checking after each that every item ran exactly once. Returns the loops where one did not (0: sound).
    For the pool's tests; a broken pool may also never return, so run it where a timeout can catch that."""
    if loops < 0 or max_items < 1 or work < 0:
        raise ValueError("loops and work must be >= 0, max_items >= 1")
    return int(lib().tg_pool_stress(loops, max_items, work))


@dataclass
class PackedMatrix:
    """A weight matrix [out_features, in_features] kept in its GGUF block format: ``data`` is uint8 [N, row bytes]
    (numpy, or a torch CPU tensor)."""

    data: Array
    fmt: int
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        # The C code trusts these sizes: check them once here, where a mistake is a ValueError and not a read past
        # the end of a buffer.
        if self.fmt not in NATIVE_FORMATS:
            raise ValueError(f"unknown block format {self.fmt}")
        if self.fmt >= Q4_0 and self.in_features % 32:
            raise ValueError(f"{NATIVE_FORMATS[self.fmt]} rows hold whole blocks of 32; {self.in_features} is not")
        if self.fmt in INTERLEAVED_FORMATS and self.out_features % GROUP_ROWS:
            raise ValueError(f"{NATIVE_FORMATS[self.fmt]} holds whole groups of {GROUP_ROWS} rows; "
                             f"{self.out_features} is not")
        expected = (self.out_features, row_bytes(self.fmt, self.in_features))
        data = _cpu_array(self.data)
        if (data is None or data.dtype != np.uint8 or tuple(data.shape) != expected
                or not data.flags.c_contiguous):
            raise ValueError(f"packed {NATIVE_FORMATS[self.fmt]} data must be contiguous uint8 {list(expected)} on the "
                             f"CPU, got {dtype_name(self.data)} {list(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return int(_np(self.data).nbytes)

    @property
    def array(self) -> np.ndarray:
        """The blocks as a numpy array (the same memory)."""
        return _np(self.data)

    def dequantize(self) -> Array:
        """float32 [out_features, in_features], of the same kind (numpy or torch) as ``data``."""
        out = np.empty((self.out_features, self.in_features), dtype=np.float32)
        _check(lib().tg_dequant(_ptr(self.array), self.fmt, self.out_features, self.in_features, _ptr(out)))
        return _like(out, self.data)


def _halves(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes holding float16 values -> float32 [..., 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def repack_q4_1(w: PackedMatrix) -> PackedMatrix:
    """Q4_1 -> Q4_1R: the same weights (halves convert to floats exactly), laid out for the single-row kernel."""
    if w.fmt != Q4_1:
        raise ValueError("only Q4_1 matrices are repacked")
    n, nb = w.out_features, w.in_features // 32
    blocks = w.array.reshape(n, nb, 20)
    d, m = _halves(blocks[:, :, 0:2]).reshape(n, nb), _halves(blocks[:, :, 2:4]).reshape(n, nb)
    qs = blocks[:, :, 4:].reshape(n, nb * 16)
    data = np.concatenate([qs, d.view(np.uint8), m.view(np.uint8)], axis=1)
    return PackedMatrix(_like(np.ascontiguousarray(data), w.data), Q4_1R, n, w.in_features)


def interleave(w: PackedMatrix) -> PackedMatrix:
    """Q4_1 / Q4_1R -> Q4_1X, Q8_0 -> Q8_0X: the same numbers laid out for the int8-activation products (groups of 16
    rows; within a group and block, 4-byte slices of the 16 rows side by side, then the rows' scales as float32)."""
    if w.out_features % GROUP_ROWS:
        raise ValueError(f"interleaving needs whole groups of {GROUP_ROWS} rows; {w.out_features} is not")
    n, nb, g = w.out_features, w.in_features // 32, w.out_features // GROUP_ROWS
    template = w.data
    if w.fmt == Q4_1R:
        w = _unrepack(w)
    if w.fmt == Q4_1:
        blocks = w.array.reshape(n, nb, 20)
        scales = [_halves(blocks[:, :, o:o + 2]) for o in (0, 2)]  # d, m: [n, nb, 1]
        qs = blocks[:, :, 4:]
        fmt, quads = Q4_1X, 4
    elif w.fmt == Q8_0:
        blocks = w.array.reshape(n, nb, 34)
        scales = [_halves(blocks[:, :, 0:2])]
        qs = blocks[:, :, 2:] ^ 0x80  # q + 128 as an unsigned byte (flipping the sign bit)
        fmt, quads = Q8_0X, 8
    else:
        raise ValueError(f"only Q4_1, Q4_1R and Q8_0 matrices are interleaved, not {NATIVE_FORMATS[w.fmt]}")
    # [g, 16 rows, nb, quads, 4 bytes] -> [g, nb, quads, 16 rows, 4 bytes]
    q = qs.reshape(g, GROUP_ROWS, nb, quads, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, quads * 64)
    parts = [q] + [np.ascontiguousarray(sc.reshape(g, GROUP_ROWS, nb).transpose(0, 2, 1)).view(np.uint8)
                   for sc in scales]
    data = np.ascontiguousarray(np.concatenate(parts, axis=2).reshape(n, -1))
    return PackedMatrix(_like(data, template), fmt, n, w.in_features)


def _unrepack(m: PackedMatrix) -> PackedMatrix:
    """Q4_1R back to GGUF's Q4_1 blocks: its float scales came from halves, so converting back is exact."""
    n, nb = m.out_features, m.in_features // 32
    a = m.array
    qs = a[:, : nb * 16].reshape(n, nb, 16)
    d = np.ascontiguousarray(a[:, nb * 16 : nb * 20]).view(np.float32).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    mins = np.ascontiguousarray(a[:, nb * 20 :]).view(np.float32).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    data = np.ascontiguousarray(np.concatenate([d, mins, qs], axis=2).reshape(n, nb * 20))
    return PackedMatrix(data, Q4_1, n, m.in_features)


def kernel_layout(m: PackedMatrix) -> PackedMatrix:
    """The layout the kernels read fastest here: with int8 activations (VNNI, not turned off), Q4_1 and Q8_0 matrices
    of whole 16-row groups interleave (Q4_1X / Q8_0X); otherwise Q4_1 is repacked (Q4_1R) and the rest stays."""
    passes = activation_passes() if m.fmt in (Q4_1, Q8_0) and m.out_features % GROUP_ROWS == 0 else 0
    if passes:
        set_activation_passes(passes)
        return interleave(m)
    return repack_q4_1(m) if m.fmt == Q4_1 else m


def _check(code: int) -> None:
    if code != 0:
        raise ValueError(f"tailguard kernel rejected its arguments (code {code})")


def linear(x: Array, w: PackedMatrix, out: Array | None = None, accumulate: bool = False) -> Array:
    """x [T, K] float32 @ W^T -> [T, N] (numpy, or torch for a torch ``x``); with ``accumulate`` adds into ``out``."""
    xa = np.ascontiguousarray(_np(x))
    if xa.dtype != np.float32 or xa.ndim != 2 or xa.shape[1] != w.in_features:
        raise ValueError("linear expects a contiguous float32 [T, in_features] input")
    out_a: np.ndarray | None
    if out is None:
        out_a = np.empty((xa.shape[0], w.out_features), dtype=np.float32)
        out = _like(out_a, x)
    else:
        out_a = _cpu_array(out)
        if (out_a is None or out_a.dtype != np.float32 or tuple(out_a.shape) != (xa.shape[0], w.out_features)
                or not out_a.flags.c_contiguous):
            raise ValueError(f"out must be a contiguous float32 [{xa.shape[0]}, {w.out_features}] CPU array")
    _check(lib().tg_linear(_ptr(xa), xa.shape[0], w.in_features, _ptr(w.array), w.fmt, w.out_features, _ptr(out_a),
                           int(accumulate)))
    return out


def embed(ids: Array, w: PackedMatrix) -> Array:
    """The rows ``ids`` of an embedding matrix, as float32 [len(ids), in_features] (the caller's kind of array)."""
    ia = np.ascontiguousarray(_np(ids), dtype=np.int64)
    out = np.empty((ia.shape[0], w.in_features), dtype=np.float32)
    _check(lib().tg_embed(_ptr(ia), ia.shape[0], _ptr(w.array), w.fmt, w.out_features, w.in_features, _ptr(out)))
    return _like(out, ids)


# --- the decode step ---------------------------------------------------------------------------------------------

class _Mat(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("fmt", ctypes.c_int32), ("N", ctypes.c_int32), ("K", ctypes.c_int32),
                ("pad", ctypes.c_int32), ("bf16", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("qkv", _Mat), ("o", _Mat),
                ("gate_up", _Mat), ("down", _Mat)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("n_heads", ctypes.c_int32), ("n_kv", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("vocab", ctypes.c_int32), ("max_pos", ctypes.c_int32), ("eps", ctypes.c_float),
                ("pad", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)), ("final_norm", ctypes.c_void_p),
                ("embed", _Mat), ("lm_head", _Mat), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]


class _KV(ctypes.Structure):
    _fields_ = [("kv", ctypes.c_void_p), ("fmt", ctypes.c_int32), ("num_blocks", ctypes.c_int32),
                ("block_size", ctypes.c_int32), ("pad", ctypes.c_int32)]


def _mat(w: PackedMatrix, bf16: np.ndarray | None = None) -> _Mat:
    return _Mat(_ptr(w.array), w.fmt, w.out_features, w.in_features, 0, None if bf16 is None else _ptr(bf16))


def amx_available() -> bool:
    """The kernels multiply bfloat16 tiles here: on the CPU's matrix units (AMX, built for them and the OS granted
    the tiles), or, on a CPU with AVX-512 BF16 and no AMX, on the kernels' software tile unit (``tile_unit``)."""
    return bool(lib().tg_amx_available())


def tile_unit() -> str | None:
    """What multiplies the bfloat16 tiles: "AMX", "AVX-512 BF16" (the software tile unit) or None (no tile path)."""
    return {1: "AMX", 2: "AVX-512 BF16"}.get(lib().tg_tile_unit())


def prompt_rows_bf16() -> bool:
    """Prompt rows of the C step go through the bfloat16 tiles (``amx_available``), unless TAILGUARD_PROMPT_BF16 is
    0."""
    return os.environ.get(PROMPT_BF16_ENV, "1") != "0" and amx_available()


def linear_bf16(x: np.ndarray, tiles: np.ndarray, out_features: int) -> np.ndarray:
    """x [T, K] float32 @ W^T through W's bfloat16 tiles (pack_bf16) on the matrix units: [T, out_features]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty((x.shape[0], out_features), dtype=np.float32)
    _check(lib().tg_linear_bf16(_ptr(x), x.shape[0], x.shape[1], _ptr(tiles), out_features, _ptr(y), 0))
    return y


def pack_bf16(w: PackedMatrix) -> np.ndarray | None:
    """W as bfloat16 tiles for the matrix units (tg_pack_bf16), or None when its shape does not tile (N or K not
    a multiple of 32)."""
    if w.out_features % 32 or w.in_features % 32:
        return None
    # on a 64-byte line (numpy puts large arrays 16 bytes into a page): a tile's rows then load one line each, and
    # the C step multiplies from W in place instead of copying each column group's tiles to an aligned buffer first
    n = w.out_features * w.in_features
    raw = np.empty(n + 32, dtype=np.uint16)
    start = (-raw.ctypes.data % 64) // 2
    out = raw[start : start + n]
    if lib().tg_pack_bf16(_ptr(w.array), w.fmt, w.out_features, w.in_features, _ptr(out)) != 0:
        return None
    return out


class DecodeStep:
    """Binds a model's packed weights and its KV cache once; ``__call__`` runs one decode step for D sequences.

    Arrays are numpy's or torch CPU tensors (viewed as numpy: the same memory). Keeps a reference to every array
    whose pointer it hands to C, so none is freed while the C side holds it.
    """

    def __init__(self, *, config, layers: list[tuple], final_norm: Array, embed_w: PackedMatrix,
                 lm_head: PackedMatrix, cos: Array, sin: Array, kv_cache: Array,
                 prompt_bf16: bool | None = None) -> None:
        """``prompt_bf16``: prompt rows through bfloat16 copies of the layers' weights on the matrix units (2 bytes a
        weight more in memory); None: where the CPU has them (prompt_rows_bf16)."""
        def f32(a: Array) -> np.ndarray:
            arr = _np(a)
            if arr.dtype != np.float32 or not arr.flags.c_contiguous:
                raise ValueError("the decode step's norms and RoPE tables are contiguous float32")
            return arr

        final_norm, cos, sin = f32(final_norm), f32(cos), f32(sin)
        kv = _np(kv_cache)
        self._keep = [final_norm, cos, sin, kv, embed_w.array, lm_head.array]
        self.prompt_bf16 = prompt_rows_bf16() if prompt_bf16 is None else prompt_bf16 and amx_available()
        self.bf16_bytes = 0
        layer_structs = []
        for attn_norm, qkv, o, ffn_norm, gate_up, down in layers:
            attn_norm, ffn_norm = f32(attn_norm), f32(ffn_norm)
            self._keep += [attn_norm, ffn_norm, qkv.array, o.array, gate_up.array, down.array]
            mats = []
            for w in (qkv, o, gate_up, down):
                tiles = pack_bf16(w) if self.prompt_bf16 else None
                if tiles is not None:
                    self._keep.append(tiles)
                    self.bf16_bytes += tiles.nbytes
                mats.append(_mat(w, tiles))
            layer_structs.append(_Layer(_ptr(attn_norm), _ptr(ffn_norm), *mats))
        self._layers = (_Layer * len(layer_structs))(*layer_structs)
        self.vocab = lm_head.out_features
        self._model = _Model(config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                             config.num_kv_heads, config.head_dim, self.vocab, cos.shape[0], config.rms_eps, 0.0,
                             self._layers, _ptr(final_norm), _mat(embed_w), _mat(lm_head), _ptr(cos), _ptr(sin))
        n_layers, two, num_blocks, block_size, n_kv, row = kv.shape
        fmt = KV_FORMATS.get(str(kv.dtype))
        # int8 rows carry their float16 scale after the head_dim values (torch_model.py's quantize_kv)
        want_row = config.head_dim + 2 if kv.dtype == np.int8 else config.head_dim
        if (fmt is None or not kv.flags.c_contiguous or two != 2 or n_layers != config.num_layers
                or n_kv != config.num_kv_heads or row != want_row):
            raise ValueError("the decode kernel reads a contiguous CPU KV cache [layers, 2, blocks, block size, kv "
                             "heads, head_dim] of float32 or float16, or int8 with head_dim + 2 bytes a row")
        self._kv = _KV(_ptr(kv), fmt, num_blocks, block_size, 0)

    def __call__(self, tokens: Array, positions: Array, slots: Array, tables: Array, ctx_lens: Array,
                 out_rows: Array | None = None, num_decode_rows: int | None = None) -> Array:
        """Logits [len(out_rows), vocab] of the rows ``out_rows`` names (None: every row), of the kind of ``tokens``.
        ``num_decode_rows``: the first rows are decodes (or verifications), the rest prompt tokens, which go through
        the matrix units when the step has them (None: every row is a decode)."""
        t, pos, sl, tab, lens = (_np(a) for a in (tokens, positions, slots, tables, ctx_lens))
        d = t.shape[0]
        if not (t.dtype == pos.dtype == sl.dtype == np.int64 and tab.dtype == lens.dtype == np.int32
                and all(a.flags.c_contiguous for a in (t, pos, sl, tab, lens))
                and pos.shape[0] == sl.shape[0] == tab.shape[0] == lens.shape[0] == d):
            raise ValueError("decode step: int64 tokens/positions/slots and int32 [D, blocks] tables and lengths")
        rows_ptr, n_out, rows = None, d, None
        if out_rows is not None:
            rows = np.ascontiguousarray(_np(out_rows), dtype=np.int32)
            rows_ptr, n_out = (_ptr(rows) if rows.size else None), rows.shape[0]
        logits = np.empty((n_out, self.vocab), dtype=np.float32)
        _check(lib().tg_decode(ctypes.byref(self._model), ctypes.byref(self._kv), d, _ptr(t), _ptr(pos), _ptr(sl),
                               _ptr(tab), tab.shape[1], _ptr(lens), n_out, rows_ptr, _ptr(logits),
                               d if num_decode_rows is None else num_decode_rows))
        return _like(logits, tokens)


PROFILE_PHASES = ("norms", "qkv", "rope + KV write", "attention", "o", "gate_up", "silu", "down", "LM head")


def profile_decode(on: bool) -> None:
    """Start (clearing) or stop accumulating the decode step's time per phase (benchmarks/profile_native_step.py)."""
    lib().tg_profile(int(on))


def profile_read() -> dict[str, float]:
    out = (ctypes.c_double * len(PROFILE_PHASES))()
    lib().tg_profile_read(out)
    return dict(zip(PROFILE_PHASES, out))


def main(argv: list[str] | None = None) -> int:
    """``python -m tailguard.engine.kernels``: build the kernels for this machine now (install scripts call it)."""
    path = build(verbose="-v" in (argv or sys.argv[1:]))
    print(f"tailguard kernels: {path} ({simd()})")
    return 0
