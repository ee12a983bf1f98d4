"""tailguard's C kernels against references: gguf's own (de)quantization with torch's F.linear, and the float32 model.

Each kernel is checked in every SIMD build this CPU can run (AVX-512, AVX2, scalar: the library is compiled with
``-march=native``, so a machine without AVX-512 runs code that this machine's default build never executes), on
shapes that reach every path: T=1 (the fused single-row product), T=4 and 16 (the 4x4 micro-kernel), T=3 and 65
(4x4 leftovers, odd sizes), N not a multiple of the 8-row / 4-row groups.

Tolerances: the kernels sum in a different order than the reference, so products are compared with a float64 reference
within the classic worst-case rounding bound K * eps * sum|x * w| (the kernels land orders of magnitude inside it); any
real bug (a wrong nibble, block offset or row) is an O(1) relative error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

from tailguard.engine import kernels  # noqa: E402
from tailguard.engine.kernels import PackedMatrix  # noqa: E402

QT = gguf.GGMLQuantizationType
FORMATS = {"F32": QT.F32, "F16": QT.F16, "Q4_0": QT.Q4_0, "Q4_1": QT.Q4_1, "Q8_0": QT.Q8_0,
           "Q4_1R": QT.Q4_1}  # Q4_1R: Q4_1 blocks repacked at load (kernels.repack_q4_1), gguf's Q4_1 as reference
EPS32 = float(np.finfo(np.float32).eps)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="tailguard's kernels need gcc on this machine")


# --- one library per SIMD build ---------------------------------------------------------------------------------

def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# name -> (extra gcc flags on top of -march=native, CPU flags needed to run it)
VARIANTS = {
    "default": (None, set()),
    "avx2": (["-mno-avx512f"], {"avx2", "fma", "f16c"}),
    "scalar": (["-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c"], set()),
}
EXPECTED_SIMD = {"avx2": "avx2", "scalar": "scalar"}


@pytest.fixture(scope="module")
def variant_libraries(tmp_path_factory) -> dict[str, Path]:
    """Each non-default build this CPU can run, compiled once per module run."""
    cc = shutil.which("gcc")
    libs = {}
    for name, (flags, needs) in VARIANTS.items():
        if flags is None or cc is None or not needs <= _cpu_flags():
            continue
        out = tmp_path_factory.mktemp(f"kernels-{name}") / "tg_kernels.so"
        cmd = [cc, "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC", "-o", str(out),
               str(kernels.SOURCE), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert result.returncode == 0, result.stderr
        libs[name] = out
    return libs


@pytest.fixture(params=list(VARIANTS))
def variant(request, variant_libraries):
    """Swaps kernels' loaded library for the variant's build for one test (and puts the default one back)."""
    name = request.param
    if VARIANTS[name][0] is None:
        yield name
        return
    if name not in variant_libraries:
        pytest.skip(f"this machine cannot build or run the {name} kernels")
    saved_lib, saved_build = kernels._lib, kernels.build
    kernels._lib = None
    kernels.build = lambda verbose=False: variant_libraries[name]  # lib() loads and declares this one
    try:
        assert kernels.simd() == EXPECTED_SIMD[name], "the variant's flags did not select its code path"
        yield name
    finally:
        kernels._lib, kernels.build = saved_lib, saved_build


# --- test matrices made with gguf's own quantizer -----------------------------------------------------------------

def packed(fmt: str, n: int, k: int, seed: int = 0) -> tuple[PackedMatrix, torch.Tensor]:
    """A random [n, k] matrix in ``fmt`` and gguf's float32 dequantization of it (the reference weights)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.2).astype(np.float32)
    if fmt in ("Q4_1", "Q4_1R"):
        w += rng.uniform(-0.3, 0.3, size=(n, 1)).astype(np.float32)  # row offsets: non-trivial block minimums
    q = quantize(w, FORMATS[fmt])
    ref = torch.from_numpy(np.array(dequantize(q, FORMATS[fmt]), dtype=np.float32).reshape(n, k))
    data = torch.from_numpy(np.ascontiguousarray(q).view(np.uint8).reshape(n, -1).copy())
    assert data.shape[1] == kernels.row_bytes(int(FORMATS[fmt]), k)
    matrix = PackedMatrix(data, int(FORMATS[fmt]), n, k)
    return (kernels.repack_q4_1(matrix) if fmt == "Q4_1R" else matrix), ref


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Worst-case float32 summation error of x @ w^T: K * eps * sum_k |x_k w_k| (plus a denormal floor)."""
    k = x.shape[1]
    return k * EPS32 * (x.abs().double() @ w.abs().double().T) + 1e-30


# N=37: four full 8-row groups, a 4-row group and a lone row; the two threads split the groups unevenly.
N_ROWS = 37
SHAPES_K = {"F32": 70, "F16": 70, "Q4_0": 96, "Q4_1": 96, "Q8_0": 96, "Q4_1R": 96}  # F32/F16: K off the vector


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("t", [1, 3, 4, 16, 65])
def test_linear_matches_f_linear_on_gguf_dequantization(variant, fmt, t):
    k = SHAPES_K[fmt]
    w, ref_w = packed(fmt, N_ROWS, k, seed=t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    exact = x.double() @ ref_w.double().T
    bound = rounding_bound(x, ref_w)

    y = kernels.linear(x, w)
    assert y.shape == (t, N_ROWS) and y.dtype == torch.float32
    assert ((y.double() - exact).abs() <= bound).all(), f"max error {(y.double() - exact).abs().max():.3g}"
    torch.testing.assert_close(y, F.linear(x, ref_w), rtol=1e-4, atol=1e-4 * float(exact.abs().max()))

    # accumulate=True adds into ``out`` instead of overwriting it.
    base = torch.randn(t, N_ROWS, generator=torch.Generator().manual_seed(100 + t))
    out = base.clone()
    returned = kernels.linear(x, w, out=out, accumulate=True)
    assert returned.data_ptr() == out.data_ptr()
    assert ((out.double() - (base.double() + exact)).abs() <= bound + base.abs().double() * EPS32).all()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_equals_gguf(variant, fmt):
    k = SHAPES_K[fmt]
    w, ref = packed(fmt, N_ROWS, k, seed=3)
    got = w.dequantize()
    if fmt in ("F32", "F16", "Q8_0"):
        assert torch.equal(got, ref)  # a conversion and at most one product: no room for a different rounding
    else:
        # d * q + m: a compiler may fuse it into one FMA (one rounding instead of two): at most one rounding of
        # d * q apart, i.e. an ulp of the block's magnitude.
        blocks = ref.view(N_ROWS, k // 32, 32)
        scale = (blocks.abs().amax(dim=-1, keepdim=True) * 2).expand_as(blocks).reshape(N_ROWS, k)
        ulp = torch.from_numpy(np.spacing(scale.numpy()))
        assert ((got - ref).abs() <= ulp).all(), f"max difference {(got - ref).abs().max():.3g}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_embed_returns_dequantized_rows(variant, fmt):
    k = SHAPES_K[fmt]
    w, ref = packed(fmt, N_ROWS, k, seed=5)
    ids = torch.tensor([0, 36, 7, 7, 12])
    got = kernels.embed(ids, w)
    assert got.shape == (5, k)
    torch.testing.assert_close(got, w.dequantize()[ids], rtol=0, atol=0)
    torch.testing.assert_close(got, ref[ids], rtol=1e-6, atol=1e-6 * float(ref.abs().max()))


def test_results_do_not_depend_on_the_thread_count_or_pool():
    """Each output row is computed whole by one thread, so splitting the rows differently (other counts, the own
    pool's dynamic chunks or OpenMP's static shares) must not change a bit."""
    w, _ = packed("Q4_1", 203, 128, seed=9)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(9))
    before = kernels.num_threads()
    try:
        results = []
        for pool in ("tailguard", "openmp"):
            kernels.set_thread_pool(pool)
            for threads in (1, 2, 3):
                kernels.set_num_threads(threads)
                assert kernels.num_threads() == threads
                results.append((kernels.linear(x, w), kernels.linear(x[:1], w), w.dequantize()))
    finally:
        kernels.set_thread_pool(kernels.thread_settings_loaded().pool)
        kernels.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


# --- int8 activations (Q4_1X / Q8_0X, AVX-512 VNNI) ---------------------------------------------------------------
#
# These products quantize each activation row per 32-element block (x8 = round(x / dx), dx = max|x| / 127) and sum in
# integers, so they differ from the float reference by the activations' rounding: |x8 dx - x| <= dx / 2 per element,
# hence |y - y_ref| <= sum_b dx_b / 2 * sum_{k in b} |w_k| (Q4_1's min term uses the float sum of x, so there only
# the d * q part counts), plus float32 rounding. That bound is ~8% of |y|'s scale at K = 96; a wrong nibble, quad,
# row or block scale is an O(1) error. The kernel is also checked against float64 emulation of the same int8
# arithmetic (rounding half to even with the float32 reciprocal scale, as the kernel does), to float rounding.

X_FORMATS = {"Q4_1X": ("Q4_1", kernels.Q4_1X), "Q8_0X": ("Q8_0", kernels.Q8_0X)}
X_ROWS = 48  # three 16-row groups: the two threads split them unevenly
needs_vnni = pytest.mark.skipif(not kernels.available() or not kernels.lib().tg_int8_dot(),
                                reason="int8 activations need an AVX-512 VNNI build")


def interleaved(name: str, n: int, k: int, seed: int) -> tuple[PackedMatrix, PackedMatrix, torch.Tensor]:
    """(the GGUF-format matrix, its interleaved layout, gguf's float32 dequantization)."""
    source, fmt = X_FORMATS[name]
    w, ref = packed(source, n, k, seed=seed)
    x = kernels.interleave(w)
    assert x.fmt == fmt
    return w, x, ref


def int8_emulation(x: torch.Tensor, w: PackedMatrix, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the int8 algorithm's result in float64, its worst-case distance from x @ ref^T)."""
    t, k = x.shape
    nb = k // 32
    xb = x.numpy().reshape(t, nb, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    x8 = np.rint((xb * inv).astype(np.float32)).astype(np.float64)  # float32 product, rounded half to even
    dx = (amax / np.float32(127)).astype(np.float32).astype(np.float64)
    blocks = w.data.numpy().reshape(w.out_features, nb, -1)
    d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float64)[..., 0]  # [n, nb]
    if w.fmt == kernels.Q4_1:
        mins = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float64)[..., 0]
        qs = blocks[:, :, 4:]
        q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.float64)  # [n, nb, 32]
        y = np.einsum("tbk,nbk,nb,tb->tn", x8, q, d, dx[..., 0]) + np.einsum(
            "nb,tb->tn", mins, xb.astype(np.float64).sum(axis=2))
        wq = q * d[..., None]  # the part of each weight that multiplies the rounded activations
    else:
        q = blocks[:, :, 2:].view(np.int8).astype(np.float64)
        y = np.einsum("tbk,nbk,nb,tb->tn", x8, q, d, dx[..., 0])
        wq = q * d[..., None]
    bound = np.einsum("tb,nb->tn", dx[..., 0] / 2 * 1.0001, np.abs(wq).sum(axis=2))
    return torch.from_numpy(y), torch.from_numpy(bound)


@pytest.fixture(params=[1, 2])
def passes(request):
    """Products with one int8 pass, or two (the rounding residual quantized again: its scale is at most dx / 254,
    so the bound above shrinks 254-fold); the process-wide setting is put back to one pass afterwards."""
    kernels.set_activation_passes(request.param)
    try:
        yield request.param
    finally:
        kernels.set_activation_passes(1)


@needs_vnni
@pytest.mark.parametrize("name", list(X_FORMATS))
@pytest.mark.parametrize("t", [1, 3, 16, 64])
def test_int8_activation_products_match_the_float_reference(name, t, passes):
    k = 96
    w, x_w, ref = interleaved(name, X_ROWS, k, seed=20 + t)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t))
    exact = x.double() @ ref.double().T
    emulated, int8_bound = int8_emulation(x, w, ref)
    float_bound = rounding_bound(x, ref) * 4  # float32 sums in a different order, and the block scales' products
    assert ((emulated - exact).abs() <= int8_bound).all()  # the bound holds for the algorithm itself

    y = kernels.linear(x, x_w)
    assert y.shape == (t, X_ROWS)
    err = (y.double() - exact).abs()
    bound = (int8_bound if passes == 1 else int8_bound / 254) + float_bound
    assert (err <= bound).all(), f"max error {err.max():.3g} vs bound {bound.max():.3g}"
    if passes == 1:
        assert ((y.double() - emulated).abs() <= float_bound + 1e-6 * exact.abs().max()).all()
    print(f"{name} T={t} passes={passes}: max |y - float reference| / max |y| = "
          f"{float(err.max() / exact.abs().max()):.2e}")

    base = torch.randn(t, X_ROWS, generator=torch.Generator().manual_seed(200 + t))
    out = base.clone()
    kernels.linear(x, x_w, out=out, accumulate=True)
    assert torch.equal(out, base + y)  # accumulate adds the same product


@needs_vnni
@pytest.mark.parametrize("name", list(X_FORMATS))
def test_int8_activation_rows_do_not_depend_on_the_batch(name, passes):
    """Each activation row is quantized alone and takes the same operations in any tile: exactly equal results."""
    w, x_w, _ = interleaved(name, X_ROWS, 128, seed=4)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    full = kernels.linear(x, x_w)
    for rows in ([5], [0, 63, 17], list(range(3, 16)), list(range(64))[::-1]):
        assert torch.equal(kernels.linear(x[rows], x_w), full[rows])


@pytest.mark.parametrize("name", list(X_FORMATS))
def test_interleaved_layouts_hold_the_same_numbers(variant, name):
    """Dequantized, embedded or multiplied with float activations (builds without VNNI read them that way), the
    interleaved layouts give what the GGUF's blocks give."""
    w, x_w, ref = interleaved(name, X_ROWS, 96, seed=8)
    assert torch.equal(x_w.dequantize(), w.dequantize())
    ids = torch.tensor([0, 47, 16, 15, 16])
    assert torch.equal(kernels.embed(ids, x_w), w.dequantize()[ids])
    if name == "Q4_1X":  # from the repacked layout too
        assert torch.equal(kernels.interleave(kernels.repack_q4_1(w)).data, x_w.data)
    if not kernels.lib().tg_int8_dot():
        x = torch.randn(16, 96, generator=torch.Generator().manual_seed(8))
        exact = x.double() @ ref.double().T
        assert ((kernels.linear(x, x_w).double() - exact).abs() <= rounding_bound(x, ref)).all()


def test_interleaving_needs_whole_groups_of_16_rows():
    w, _ = packed("Q8_0", 40, 64)
    with pytest.raises(ValueError, match="16"):
        kernels.interleave(w)
    x_w = kernels.interleave(packed("Q8_0", 48, 64)[0])
    with pytest.raises(ValueError, match="16"):  # e.g. a head cut to a row count that splits a group
        PackedMatrix(x_w.data[:40].contiguous(), x_w.fmt, 40, 64)


# --- bad arguments: a ValueError, never a crash -----------------------------------------------------------------

@pytest.mark.parametrize("bad_id", [-1, N_ROWS, 10**12])
def test_embed_rejects_an_out_of_range_id(bad_id):
    w, _ = packed("Q8_0", N_ROWS, 64)
    with pytest.raises(ValueError):
        kernels.embed(torch.tensor([1, bad_id]), w)


@pytest.mark.parametrize("fmt", [6, 12, 99, -1])  # Q5_0, Q4_K (real ggml types the kernels do not read), nonsense
def test_unknown_formats_are_rejected(fmt):
    w, _ = packed("Q8_0", 8, 64)
    with pytest.raises(ValueError, match="format"):  # refused when the matrix is made, before any C call
        PackedMatrix(w.data, fmt, 8, 64)


def test_block_formats_need_whole_blocks():
    w, _ = packed("F32", 8, 48)
    with pytest.raises(ValueError, match="whole blocks"):  # 48 is not a multiple of the 32-weight block
        PackedMatrix(w.data, int(QT.Q8_0), 8, 48)


@pytest.mark.parametrize("x", [torch.randn(2, 63), torch.randn(2, 64, dtype=torch.float64), torch.randn(64)])
def test_linear_rejects_a_wrong_input(x):
    w, _ = packed("Q4_1", 8, 64)
    with pytest.raises(ValueError):
        kernels.linear(x, w)


# --- the whole decode step (tg_decode) against the float32 model --------------------------------------------------
#
# The same tiny GGUF loaded twice: native (the C decode step on the file's blocks) and float32 (gguf's dequantization
# of the same blocks, torch ops). The file is stored like SmolLM2's (Q4_1 layers, Q8_0 embedding and LM head); the F32
# matrices of the plain tiny model take the kernels' non-fused path, which the products above already cover. Contexts of 300 and 600 tokens span 2 and 3 of the kernel's 256-position
# attention slices, so the slices' log-sum-exp merge is exercised; one sequence crosses a slice edge mid-decode.
#
# Tolerance: measured max |native - float32| / max |logit| is 3e-7 to 4.4e-7 (float32 rounding in a different order).
# The bound, 1e-4, leaves a 200x margin and still catches subtle bugs: with the slices' merge weights deliberately
# wrong (exp(0.5 * (m_s - m)) for exp(m_s - m)) this random model's logits move by only 3e-3 to 9e-3 of their scale,
# which a 1e-3 bound would barely see.
DECODE_RTOL = 1e-4
DECODE_STEPS = 4
BATCHES = {
    "1 seq, 3 slices": [600],
    "3 seqs": [300, 17, 600],
    "6 seqs, one crosses a slice edge": [5, 254, 600, 33, 300, 129],
}


@pytest.fixture(scope="module")
def tiny_quantized_gguf(smollm2_path, tmp_path_factory) -> Path:
    """A tiny random model stored like SmolLM2's GGUF (Q4_1 layers, Q8_0 embedding and LM head)."""
    return write_quantized_tiny(tmp_path_factory.mktemp("tiny-native") / "tiny-q4_1.gguf", smollm2_path)


@pytest.fixture(scope="module")
def tiny_quantized_gguf_smollm2_heads(smollm2_path, tmp_path_factory) -> Path:
    """The same with SmolLM2's attention shape: 3 query heads a KV head, 64 dims a head (kernels specialize it)."""
    return write_quantized_tiny(tmp_path_factory.mktemp("tiny-native-g3") / "tiny-q4_1-g3.gguf", smollm2_path,
                                hidden_size=192, num_heads=3, num_kv_heads=1)


def write_quantized_tiny(path: Path, smollm2_path: Path, **shape) -> Path:
    from tailguard.engine.loader import write_tiny_gguf

    # Quantize each matrix as it is written, the way SmolLM2's GGUF stores them.
    original = gguf.GGUFWriter.add_tensor

    def add_quantized(self, name, tensor, *args, **kwargs):
        if tensor.ndim == 2 and not args and not kwargs:
            qtype = QT.Q8_0 if name in ("token_embd.weight", "output.weight") else QT.Q4_1
            return original(self, name, quantize(tensor, qtype), raw_dtype=qtype)
        return original(self, name, tensor, *args, **kwargs)

    gguf.GGUFWriter.add_tensor = add_quantized
    try:
        write_tiny_gguf(path, smollm2_path, tie_embeddings=False, seed=1, **shape)
    finally:
        gguf.GGUFWriter.add_tensor = original
    return path


def tiny_engine(path: Path, fmt: str, kv_dtype: str = "float16", int8_activations: int = 0, block_size: int = 16):
    """An engine on ``path``; native matrices load for float32 activations (the exact-arithmetic products these
    tests hold to 1e-4) unless ``int8_activations`` (1: int8, 2: int8 and its residual)."""
    from tailguard.engine.engine import EngineArgs, LLMEngine

    saved = os.environ.get(kernels.INT8_ACTIVATIONS_ENV)
    os.environ[kernels.INT8_ACTIVATIONS_ENV] = str(int8_activations)
    try:
        return LLMEngine(EngineArgs(model=str(path), weight_format=fmt, kv_cache_tokens=8192, max_num_seqs=16,
                                    max_num_batched_tokens=128, max_prefill_chunk=96, num_threads=2,
                                    kv_cache_dtype=kv_dtype, runner="torch", block_size=block_size))
    finally:
        if saved is None:
            del os.environ[kernels.INT8_ACTIVATIONS_ENV]
        else:
            os.environ[kernels.INT8_ACTIVATIONS_ENV] = saved


@pytest.fixture(scope="module")
def tiny_pair(tiny_quantized_gguf):
    """(native engine, float32 engine) on the same tiny GGUF with quantized matrices."""
    native, reference = tiny_engine(tiny_quantized_gguf, "native"), tiny_engine(tiny_quantized_gguf, "float32")
    assert native.weight_format == "native" and reference.weight_format == "float32"
    formats = {lin.packed.fmt for layer in native.model.layers for lin in (layer[1], layer[2], layer[4], layer[5])}
    # the layers load repacked for the kernels (Q4_1R: the same numbers as the file's Q4_1)
    assert formats == {kernels.Q4_1R} and native.model.lm_head.packed.fmt == int(QT.Q8_0)
    return native, reference


def teacher_forced_decode(engine, texts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], int]:
    """Prefill each text but its last ``steps`` tokens, then ``steps`` decode steps with every sequence in the batch,
    feeding the text's own next token. Returns the logits [D, vocab] of each decode step and how many steps (the
    prefills included) went through the native whole-step kernel."""
    from tailguard.engine.blocks import BlockTable
    from tailguard.engine.scheduler import ScheduledChunk
    from tailguard.engine.sequence import SamplingParams, Sequence

    runner, model = engine.runner, engine.runner.model
    native_calls = 0
    real_native_decode = model._native_decode

    def counting(*args):
        nonlocal native_calls
        native_calls += 1
        return real_native_decode(*args)

    model._native_decode = counting
    tables, seqs = {}, []
    try:
        for i, text in enumerate(texts):
            rid = f"decode-{i}"
            tables[rid] = BlockTable(engine.pool, rid)
            assert tables[rid].ensure(len(text))
            seq = Sequence(request_id=rid, prompt_token_ids=list(text[: len(text) - steps]), sampling=SamplingParams())
            ids, meta, idx = runner._build([ScheduledChunk(seq, 0, seq.num_tokens)], tables)
            model.forward(ids, meta, runner.kv_cache, idx)
            seqs.append(seq)
        out = []
        for _ in range(steps):
            for seq, text in zip(seqs, texts):
                seq.output_token_ids.append(text[seq.num_tokens])
            chunks = [ScheduledChunk(seq, seq.num_tokens - 1, 1) for seq in seqs]
            ids, meta, idx = runner._build(chunks, tables)
            out.append(model.forward(ids, meta, runner.kv_cache, idx).float().clone())
    finally:
        del model._native_decode
        for table in tables.values():
            table.release()
    return out, native_calls


def random_texts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 49000, size=n + DECODE_STEPS).tolist() for n in lengths]


@pytest.mark.parametrize("batch", list(BATCHES))
def test_native_decode_step_matches_float32(tiny_pair, batch):
    native, reference = tiny_pair
    texts = random_texts(BATCHES[batch], seed=len(BATCHES[batch]))
    ours, native_calls = teacher_forced_decode(native, texts, DECODE_STEPS)
    theirs, reference_calls = teacher_forced_decode(reference, texts, DECODE_STEPS)
    assert native_calls == len(texts) + DECODE_STEPS and reference_calls == 0, \
        "the native engine must prefill and decode in the C kernel"
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape == (len(texts), native.config.vocab_size)
        scale = float(b.abs().max())
        diff = (a - b).abs().amax(dim=1)
        print(f"{batch} step {step}: max |native - float32| / max |logit| = {float(diff.max()) / scale:.2e}")
        assert float(diff.max()) <= DECODE_RTOL * scale, (
            f"step {step}: max |native - float32| per sequence {diff.tolist()} vs max |logit| {scale:.3g}")
        assert torch.equal(a.argmax(dim=1), b.argmax(dim=1))


def test_native_greedy_output_equals_float32(tiny_pair):
    from tailguard.engine.sequence import SamplingParams

    native, reference = tiny_pair
    prompts = random_texts([600, 300, 3, 40, 255], seed=7)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ours, theirs = native.generate(prompts, params), reference.generate(prompts, params)
    assert all(len(o) == 12 for o in ours)
    assert ours == theirs
    for engine in tiny_pair:
        assert engine.pool.num_used == 0


# --- arguments the kernels read or write without checking its size ----------------------------------------------
#
# Run in a child process: before kernels/__init__.py checked sizes these read past a buffer (garbage or a segfault) or
# wrote past one (heap corruption); a ValueError is what they must give.

CHILD_CASES = {
    "packed data shorter than its rows": (
        "w = PackedMatrix(torch.zeros(1, 40, dtype=torch.uint8), 3, 4096, 64)\n"
        "kernels.linear(torch.randn(1, 64), w)"),
    "out smaller than the product": (
        "w = PackedMatrix(torch.zeros(37, 40, dtype=torch.uint8), 3, 37, 64)\n"
        "kernels.linear(torch.randn(4, 64), w, out=torch.zeros(1, 2), accumulate=True)"),
    "out of the wrong dtype": (
        "w = PackedMatrix(torch.zeros(37, 40, dtype=torch.uint8), 3, 37, 64)\n"
        "kernels.linear(torch.randn(4, 64), w, out=torch.zeros(4, 37, dtype=torch.float16))"),
}


@pytest.mark.parametrize("case", list(CHILD_CASES))
def test_mis_sized_buffers_are_rejected(case):
    import sys

    code = ("import torch\nfrom tailguard.engine import kernels\nfrom tailguard.engine.kernels import PackedMatrix\n"
            "try:\n    " + CHILD_CASES[case].replace("\n", "\n    ") + "\nexcept ValueError:\n    print('ValueError')\n"
            "else:\n    print('accepted')\n")
    src = str(Path(kernels.__file__).resolve().parents[3])  # the child imports the same tailguard as this process
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                            env=env)
    assert result.returncode == 0, f"the child crashed ({result.returncode}): {result.stderr[-500:]}"
    assert result.stdout.strip() == "ValueError", result.stdout


def test_decode_logits_do_not_depend_on_the_batch(tiny_pair):
    """A sequence decoded alone or with five others gets the same logits (to rounding: one row takes the fused
    single-row product, several the 4x4 tiles), in both formats."""
    texts = random_texts(BATCHES["6 seqs, one crosses a slice edge"], seed=3)
    for engine in tiny_pair:
        batched, _ = teacher_forced_decode(engine, texts, DECODE_STEPS)
        for i in (0, 2):
            alone, _ = teacher_forced_decode(engine, [texts[i]], DECODE_STEPS)
            for step in range(DECODE_STEPS):
                a, b = alone[step][0], batched[step][i]
                assert float((a - b).abs().max()) <= DECODE_RTOL * float(b.abs().max()), (engine.weight_format, i)


# --- int8 KV cache: the C decode step against the torch path, both reading the same int8 rows ----------------------
#
# Both engines store K/V as int8 with a float16 scale per (position, kv head) and quantize with the same arithmetic
# (model.quantize_kv, tg_kernels.c's kv_store), so they read the same numbers up to the rare row whose K/V, computed
# in a different float order, lands on the other side of a rounding boundary. Measured: max |C - torch| / max |logit|
# ~1e-6 (under 1e-5 across steps and batches); the bound 1e-4 is the float path's. A wrong scale offset or row stride
# moves logits by O(1).


@pytest.fixture(scope="module")
def tiny_pair_int8(tiny_quantized_gguf):
    native, reference = tiny_engine(tiny_quantized_gguf, "native", "int8"), tiny_engine(tiny_quantized_gguf, "float32",
                                                                                           "int8")
    assert native.runner.kv_cache.dtype == reference.runner.kv_cache.dtype == torch.int8
    return native, reference


@pytest.mark.parametrize("batch", ["1 seq, 3 slices", "6 seqs, one crosses a slice edge"])
def test_int8_kv_decode_step_matches_the_torch_path(variant, tiny_pair_int8, batch):
    native, reference = tiny_pair_int8
    texts = random_texts(BATCHES[batch], seed=11)
    ours, native_calls = teacher_forced_decode(native, texts, DECODE_STEPS)
    theirs, reference_calls = teacher_forced_decode(reference, texts, DECODE_STEPS)
    assert native_calls == len(texts) + DECODE_STEPS and reference_calls == 0
    for step, (a, b) in enumerate(zip(ours, theirs)):
        scale = float(b.abs().max())
        diff = float((a - b).abs().max())
        print(f"{variant} {batch} step {step}: int8 KV, max |C - torch| / max |logit| = {diff / scale:.2e}")
        assert diff <= DECODE_RTOL * scale
        assert torch.equal(a.argmax(dim=1), b.argmax(dim=1))
    for engine in tiny_pair_int8:
        assert engine.pool.num_used == 0


# With AVX-512, decode attention scores 16 positions at a time (K rows converted once, the 16 dot products summed
# by one transposing tree) and holds a head group's outputs in registers; elsewhere, and when asked, it takes the
# generic path. Same numbers up to float32 summation order: measured max |fast - generic| / max |logit| below 1e-6.
# Block size 12: KV blocks end inside a group of 16 positions, so the slice's walk over the block table is checked.
# SmolLM2's heads (3 query heads a KV head, 64 dims): the path specialized for them.
@pytest.mark.parametrize("kv_dtype, block_size, heads", [("float32", 16, "tiny"), ("float16", 16, "tiny"),
                                                         ("int8", 16, "tiny"), ("int8", 12, "tiny"),
                                                         ("int8", 16, "smollm2"), ("float16", 12, "smollm2")])
def test_fast_decode_attention_equals_the_generic_path(request, kv_dtype, block_size, heads):
    if kernels.simd() != "avx512":
        pytest.skip("the fast attention path is AVX-512 only")
    path = request.getfixturevalue("tiny_quantized_gguf" if heads == "tiny" else "tiny_quantized_gguf_smollm2_heads")
    engine = tiny_engine(path, "native", kv_dtype, block_size=block_size)
    texts = random_texts(BATCHES["6 seqs, one crosses a slice edge"], seed=5)  # tails of 16 and slice edges
    fast, calls = teacher_forced_decode(engine, texts, DECODE_STEPS)
    kernels.set_generic_attention(True)
    try:
        generic, _ = teacher_forced_decode(engine, texts, DECODE_STEPS)
    finally:
        kernels.set_generic_attention(False)
    assert calls == len(texts) + DECODE_STEPS
    for a, b in zip(fast, generic):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= 1e-5 * scale
        assert torch.equal(a.argmax(dim=1), b.argmax(dim=1))


def test_int8_kv_rows_written_by_c_equal_the_torch_quantizer(tiny_pair_int8):
    """After a C decode step, the K/V row it wrote equals model.quantize_kv of the same values (computed here from
    the float K/V the torch path writes for that token), to at most one quantum in a few elements."""
    from tailguard.engine.torch_model import dequantize_kv

    native, reference = tiny_pair_int8
    text = random_texts([40], seed=5)
    teacher_forced_decode(native, text, 1)
    native_rows = native.runner.kv_cache.clone()
    teacher_forced_decode(reference, text, 1)
    reference_rows = reference.runner.kv_cache
    # Both engines hand out the same blocks to the same single request: the caches are comparable byte for byte.
    q_native, q_ref = native_rows[..., :-2].int(), reference_rows[..., :-2].int()
    written = (reference_rows != 0).any(dim=-1)
    assert int(written.sum()) > 0
    assert int((q_native - q_ref).abs().max()) <= 1
    assert float((q_native != q_ref).float().mean()) < 0.01
    deq_n, deq_r = dequantize_kv(native_rows), dequantize_kv(reference_rows)
    assert float((deq_n - deq_r).abs().max()) <= 2e-2 * float(deq_r.abs().max())


# --- the decode step with int8 activations (TAILGUARD_INT8_ACTIVATIONS=1 on an AVX-512 VNNI CPU) -------------------
#
# Against the float32 engine the logits move by the activations' 8-bit rounding (per 32-element block, every product
# of every layer and the LM head): measured max |int8 - float32| / max |logit| 7e-3 to 2.4e-2 on this random model
# (its activations are less regular than a trained model's); the bound 6e-2 leaves a 2.5x margin and is far below a
# real bug's O(1) (a wrong nibble, group or scale). The per-row quantization makes a sequence's logits exactly
# independent of the rest of the batch.
# With the residual pass too (the default) the activations carry ~16 bits: measured 2.6e-5 to 1.0e-4 (bound 1e-3).
INT8_DECODE_RTOL = {1: 6e-2, 2: 1e-3}


@pytest.fixture(scope="module", params=[1, 2], ids=["int8", "int8+residual"])
def tiny_native_int8(request, tiny_quantized_gguf):
    if not kernels.available() or not kernels.lib().tg_int8_dot():
        pytest.skip("int8 activations need an AVX-512 VNNI build")
    engine = tiny_engine(tiny_quantized_gguf, "native", int8_activations=request.param)
    engine.activation_passes = request.param
    kernels.set_activation_passes(request.param)
    formats = {lin.packed.fmt for layer in engine.model.layers for lin in (layer[1], layer[2], layer[4], layer[5])}
    assert formats == {kernels.Q4_1X} and engine.model.lm_head.packed.fmt == kernels.Q8_0X
    return engine


@pytest.mark.parametrize("batch", ["1 seq, 3 slices", "6 seqs, one crosses a slice edge"])
def test_int8_activation_decode_step_matches_float32(tiny_native_int8, tiny_pair, batch):
    reference = tiny_pair[1]
    texts = random_texts(BATCHES[batch], seed=13)
    ours, native_calls = teacher_forced_decode(tiny_native_int8, texts, DECODE_STEPS)
    theirs, _ = teacher_forced_decode(reference, texts, DECODE_STEPS)
    assert native_calls == len(texts) + DECODE_STEPS
    for step, (a, b) in enumerate(zip(ours, theirs)):
        scale = float(b.abs().max())
        diff = float((a - b).abs().max())
        passes = tiny_native_int8.activation_passes
        print(f"{batch} step {step}: {passes} int8 pass(es), max |native - float32| / max |logit| = {diff / scale:.2e}")
        assert diff <= INT8_DECODE_RTOL[passes] * scale


def test_int8_activation_decode_does_not_depend_on_the_batch(tiny_native_int8):
    texts = random_texts(BATCHES["6 seqs, one crosses a slice edge"], seed=3)
    batched, _ = teacher_forced_decode(tiny_native_int8, texts, DECODE_STEPS)
    for i in (0, 2):
        alone, _ = teacher_forced_decode(tiny_native_int8, [texts[i]], DECODE_STEPS)
        for step in range(DECODE_STEPS):
            assert torch.equal(alone[step][0], batched[step][i])


def prompt_logits_whole_and_chunked(engine) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of a 300-token prompt's last token, prefilled (a) in one chunk, alone, and (b) in three chunks
    beside another sequence's prefill and decodes."""
    from tailguard.engine.blocks import BlockTable
    from tailguard.engine.scheduler import ScheduledChunk
    from tailguard.engine.sequence import SamplingParams, Sequence

    runner, model = engine.runner, engine.runner.model
    prompt, other = random_texts([300, 40], seed=21)
    tables: dict[str, BlockTable] = {}

    def sequence(rid: str, tokens: list[int]) -> Sequence:
        tables[rid] = BlockTable(engine.pool, rid)
        assert tables[rid].ensure(len(tokens) + 8)
        return Sequence(request_id=rid, prompt_token_ids=list(tokens), sampling=SamplingParams())

    def step(chunks: list[ScheduledChunk]) -> torch.Tensor:
        ids, meta, idx = runner._build(chunks, tables)
        assert meta.num_decodes == ids.shape[0], "every token of the step must be a row of the C step"
        return model.forward(ids, meta, runner.kv_cache, idx)

    try:
        alone = sequence("alone", prompt)
        whole = step([ScheduledChunk(alone, 0, alone.num_tokens)])[0]
        chunked, mate = sequence("chunked", prompt), sequence("mate", other)
        assert step([ScheduledChunk(chunked, 0, 100), ScheduledChunk(mate, 0, mate.num_tokens)]).shape[0] == 1
        mate.output_token_ids.append(7)
        step([ScheduledChunk(mate, mate.num_tokens - 1, 1), ScheduledChunk(chunked, 100, 100)])
        mate.output_token_ids.append(9)
        last = step([ScheduledChunk(mate, mate.num_tokens - 1, 1),
                     ScheduledChunk(chunked, 200, chunked.num_tokens - 200)])
        assert last.shape[0] == 2
    finally:
        for table in tables.values():
            table.release()
    assert engine.pool.num_used == 0
    return whole, last[1]


def test_int8_activation_prompt_rows_do_not_depend_on_chunking_or_step_mates(tiny_native_int8):
    """In the C step each prompt token is a row of its own, and with int8 activations (per-row scales, exact integer
    sums, attention per row) its numbers are bitwise the same however its prompt is chunked and whoever shares the
    step."""
    whole, chunked = prompt_logits_whole_and_chunked(tiny_native_int8)
    assert torch.equal(chunked, whole)


def test_float_activation_prompt_rows_do_not_depend_on_chunking_or_step_mates(tiny_pair):
    """The same with float activations, up to float32 summation order (the single-row and multi-row products add in
    different orders): measured 1.4e-7 of the logits' scale."""
    whole, chunked = prompt_logits_whole_and_chunked(tiny_pair[0])
    assert float((chunked - whole).abs().max()) <= 1e-5 * float(whole.abs().max())


def test_a_step_with_a_long_prefill_chunk_runs_in_torch(tiny_pair):
    """Prefill chunks run as C rows only while they end within native_prefill_max_context positions (beyond, the C
    step's attention, one key read per query row, is slower than torch's): a step with a longer one, decodes beside
    it included, is built for torch."""
    from tailguard.engine.blocks import BlockTable
    from tailguard.engine.scheduler import ScheduledChunk
    from tailguard.engine.sequence import SamplingParams, Sequence

    engine = tiny_pair[0]
    runner = engine.runner
    prompt, other = random_texts([300, 40], seed=4)
    tables = {rid: BlockTable(engine.pool, rid) for rid in ("long", "short")}
    try:
        for rid, text in (("long", prompt), ("short", other)):
            assert tables[rid].ensure(len(text) + 8)
        long_seq = Sequence(request_id="long", prompt_token_ids=list(prompt), sampling=SamplingParams())
        short_seq = Sequence(request_id="short", prompt_token_ids=list(other), sampling=SamplingParams())
        step = [ScheduledChunk(long_seq, 200, long_seq.num_tokens - 200), ScheduledChunk(short_seq, 0, 40)]
        _, meta, _ = runner._build(step, tables)
        assert meta.num_decodes == long_seq.num_tokens - 200 + 40 and not meta.prefills
        runner.native_prefill_max_context = 256
        _, meta, _ = runner._build(step, tables)
        assert meta.num_decodes == 0 and len(meta.prefills) == 2
    finally:
        del runner.native_prefill_max_context
        for table in tables.values():
            table.release()


def test_load_build_loads_another_library_and_leaves_the_active_one():
    active = kernels.lib()
    source = kernels.SOURCE
    other = kernels.load_build(source)  # the same source: its cached build, no compile
    assert other is not active and other.tg_abi_version() == kernels.ABI_VERSION
    assert kernels.lib() is active and source == kernels.SOURCE


def test_the_tile_unit_is_the_one_this_cpu_offers():
    """AMX where the CPU has its bfloat16 tiles (and the OS grants them), the software tile unit where it has AVX-512
    BF16 without them, none elsewhere: a build that missed the CPU's instructions would quietly run prompts on the
    block kernels, 1.2-10x slower (docs/benchmarks.md)."""
    flags = _cpu_flags()
    unit = kernels.tile_unit()
    if {"amx_tile", "amx_bf16"} <= flags:
        assert unit in ("AMX", None)  # None: the OS refused the tiles (Linux before 5.16, a hypervisor's mask)
    elif "avx512_bf16" in flags:
        assert unit == "AVX-512 BF16" and kernels.amx_available()
    else:
        assert unit is None and not kernels.amx_available()
