"""Loads fourfold's fused CPU decode kernels (cpu_kernels.c): compiled once with the system C compiler, called via ctypes.

    k = cpu_kernels.load()                    # None when off, no compiler, or the build failed
    k.add_rms_norm(residual, add, weight, out, eps)     # tensors on the CPU, bf16 or float32, contiguous

Why our own C: PyTorch has no fused CPU ops for a decode step (intel-extension-for-pytorch had some but
is retired, with no build for current torch), and a small model's CPU step is mostly the fixed cost of
eager ops. The C file needs no torch headers, so it compiles in about a second with `cc -O3
-march=native -shared -fPIC -fopenmp` (OpenMP resolves to the libgomp torch has already loaded, so both
share one thread pool; where torch brings no libgomp, only `-fopenmp-simd`: no second runtime). The
library is cached under $XDG_CACHE_HOME/fourfold/ (default ~/.cache/fourfold/), named by a hash of the
source, compiler, flags and the CPU's feature flags, so a changed file or another machine builds afresh. Set FOURFOLD_CPU_KERNELS=0
to run the plain torch path; when no compiler is found or the build fails, the torch path runs and one
debug-level log line says why. Only ever called with CPU tensors (the GPU paths never load it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import torch

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("cpu_kernels.c")
BASE_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off"]
WIDE = ["-mprefer-vector-width=512"]
"""512-bit vectors where the compiler knows the option (x86); dropped where it does not."""
THREADS, NO_THREADS = ["-fopenmp"], ["-fopenmp-simd"]
"""OpenMP threads only when torch's own libgomp is loaded (ours then binds to it, one thread pool); otherwise
only the simd pragmas, so a second OpenMP runtime never competes with torch's threads."""
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
"""Activation dtypes the kernels handle (others run the torch path)."""

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "ff_add_rms_norm": [_P, _P, _P, _P, _I, _I, _F],
    "ff_rope_write_kv": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P],
    "ff_paged_attention": [_P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _P],
    "ff_silu_mul": [_P, _I, _I, _P],
}


def enabled() -> bool:
    """False when FOURFOLD_CPU_KERNELS is 0/false/off."""
    return os.environ.get("FOURFOLD_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "off", "no")


def compiler() -> str | None:
    """The C compiler to use: $CC, else cc, gcc or clang on PATH; None if there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    """The CPU's feature flags (part of the cache key: -march=native builds for this CPU only)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform
    return platform.processor() + platform.machine()


def _gomp_loaded() -> bool:
    """Whether a GNU OpenMP runtime is mapped into this process already (torch's Linux wheels bring one)."""
    try:
        return any(pathlib.Path(line.split()[-1]).name.startswith("libgomp")
                   for line in pathlib.Path("/proc/self/maps").read_text().splitlines() if "/" in line)
    except OSError:
        return False


def cache_dir() -> pathlib.Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "fourfold"


def _compile(cc: str, source: pathlib.Path) -> pathlib.Path:
    """The path of the built library (built now unless cached); raises on failure."""
    text = source.read_bytes()
    threads = THREADS if _gomp_loaded() else NO_THREADS
    for flags in (BASE_FLAGS + WIDE + threads, BASE_FLAGS + threads, BASE_FLAGS):
        key = hashlib.sha256(b"\0".join([text, cc.encode(), " ".join(flags).encode(), _cpu_flags().encode()]))
        target = cache_dir() / f"cpu_kernels-{key.hexdigest()[:20]}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = pathlib.Path(tmp) / target.name
            done = subprocess.run([cc, *flags, "-o", str(built), str(source), "-lm"], capture_output=True, text=True,
                                  timeout=120)
            if done.returncode == 0:
                os.replace(built, target)  # atomic: processes building at once each end with a whole file
                return target
            log.debug("cpu kernels: %s %s failed: %s", cc, " ".join(flags), done.stderr.strip()[-2000:])
    raise RuntimeError("the C compiler failed on cpu_kernels.c")


class Kernels:
    """The library's functions, taking tensors (CPU, contiguous, bf16 or float32) and Python numbers."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.fns = {}
        for name, args in SIGNATURES.items():
            for suffix in SUFFIX.values():
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = args, None
                self.fns[name, suffix] = fn
        lib.ff_max_threads.restype = ctypes.c_int

    def get(self, name: str, dtype: torch.dtype):
        """The raw ctypes function `name` for activations of `dtype` (arguments: data pointers and ints)."""
        return self.fns[name, SUFFIX[dtype]]

    def add_rms_norm(self, residual, add, weight, out, eps: float) -> None:
        """residual += add (in place, skipped if add is None); out = rms_norm(residual) * weight (float32 weight)."""
        dim = residual.shape[-1]
        self.get("ff_add_rms_norm", residual.dtype)(
            residual.data_ptr(), None if add is None else add.data_ptr(), weight.data_ptr(), out.data_ptr(),
            residual.numel() // dim, dim, eps)

    def rope_write_kv(self, qkv, hq: int, hkv: int, d: int, cos, sin_signed, slots, q_out, k_cache, v_cache) -> None:
        """Rotary on q and k of the fused qkv rows, q into q_out, k and v into the pool at `slots` (int64)."""
        self.get("ff_rope_write_kv", qkv.dtype)(
            qkv.data_ptr(), qkv.shape[0], hq, hkv, d, cos.data_ptr(), sin_signed.data_ptr(), slots.data_ptr(),
            q_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())

    def paged_attention(self, q, k_cache, v_cache, tables, seq_lens, query_start, block_size: int, scale: float,
                        out) -> None:
        """Causal paged attention of q (T, hq, d) over the pool (slots, hkv, d); int32 tables/lens/starts."""
        hq, d = q.shape[1], q.shape[2]
        self.get("ff_paged_attention", q.dtype)(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
            seq_lens.data_ptr(), query_start.data_ptr(), seq_lens.shape[0], hq, k_cache.shape[-2], d, block_size,
            scale, out.data_ptr())

    def silu_mul(self, gate_up, out) -> None:
        """out = silu(gate) * up for gate_up = [gate | up] rows."""
        ffn = out.shape[-1]
        self.get("ff_silu_mul", gate_up.dtype)(gate_up.data_ptr(), gate_up.shape[0], ffn, out.data_ptr())


@functools.cache
def load() -> Kernels | None:
    """The compiled kernels, or None (turned off, no compiler, or the build or load failed: logged at debug)."""
    if not enabled():
        log.debug("cpu kernels: off (FOURFOLD_CPU_KERNELS)")
        return None
    cc = compiler()
    if cc is None:
        log.debug("cpu kernels: no C compiler found; the torch path runs")
        return None
    try:
        return Kernels(ctypes.CDLL(str(_compile(cc, SOURCE))))
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        log.debug("cpu kernels: unavailable (%s); the torch path runs", e)
        return None
