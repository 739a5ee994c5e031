"""CUDA C++ kernels compiled at run time with NVRTC and launched on torch's stream (through NVIDIA's cuda-bindings).

    kernel = compiled_kernel(source, "name", {"WARPS": 8}, device)    # compiled once per (source, defines, device)
    launch(kernel, grid, block, [tensor_or_None, 3, 1e-5, ...], device, pdl=True)

For the few kernels Triton cannot express well (fourfold.quant.int4_mma: tensor-core fragments filled from
registers). cuda-bindings (`pip install cuda-bindings`, in fourfold's `gpu` extra) wraps NVRTC and the driver
API; it finds the NVRTC library torch's CUDA wheels install. Launches carry programmatic dependent launch when
asked (the kernel then calls griddepcontrol.wait before reading what the previous kernel wrote), and go on
torch's current stream, so they are captured in CUDA graphs like any torch kernel. Each launch from Python
costs tens of microseconds: meant for graph-captured decode steps.
"""

from __future__ import annotations

import ctypes
import functools

import torch

try:
    from cuda.bindings import driver, nvrtc
except ImportError:  # CPU installs, or GPU ones without the gpu extra: callers use their Triton kernels
    driver = nvrtc = None


def available() -> bool:
    """Whether cuda-bindings imported, so kernels can be compiled and launched here."""
    return driver is not None


def _check(result, what: str):
    """cuda-bindings calls return (status, *values); raise on a non-success status, else return the values."""
    status, *values = result
    if int(status) != 0:
        raise RuntimeError(f"{what} failed: {status!r}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _compile(source: str, name: str, options: tuple[str, ...]) -> bytes:
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options]
        status, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(status) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile {name}:\n{log.decode(errors='replace')}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_cubin(source: str, name: str, defines: dict[str, int], arch: str) -> bytes:
    """The cubin of `source` for `arch` ("sm_90"), with `defines` as -D flags (works without a GPU)."""
    options = (f"--gpu-architecture={arch}", "--std=c++17", *(f"-D{k}={v}" for k, v in sorted(defines.items())))
    return _compile(source, name, options)


@functools.lru_cache(maxsize=None)
def _kernel(source: str, name: str, defines: tuple, device_index: int):
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin = compile_cubin(source, name, dict(defines), f"sm_{major}{minor}")
    with torch.cuda.device(device_index):
        torch.cuda.current_stream().synchronize()   # the primary context exists and is current
        module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        return _check(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction"), module


def compiled_kernel(source: str, name: str, defines: dict[str, int], device: torch.device):
    """The `extern "C"` kernel `name` of `source` built for `device`'s GPU with `defines` (cached)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _kernel(source, name, tuple(sorted(defines.items())), index)[0]


_attributes_set: set[tuple[int, str, int]] = set()


def _set_once(kernel, attribute: str, value: int) -> None:
    """cuFuncSetAttribute(kernel, CU_FUNC_ATTRIBUTE_<attribute>, value) the first time it is asked for."""
    key = (int(kernel), attribute, value)
    if key not in _attributes_set:
        _check(driver.cuFuncSetAttribute(kernel, getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attribute}"),
                                         value), "cuFuncSetAttribute")
        _attributes_set.add(key)


def launch(kernel, grid: int, block: int, args: list, device: torch.device, pdl: bool = False,
           shared_bytes: int = 0, carveout: int | None = None) -> None:
    """Launch `kernel` on torch's current stream of `device`: tensors (or None) go as pointers, Python ints as
    32-bit ints, floats as 32-bit floats; `pdl` sets programmatic stream serialization (Hopper and newer);
    `shared_bytes` of dynamic shared memory (the kernel is opted in to the size first); `carveout`: the preferred
    percent of the SM's unified L1 / shared memory that is shared memory (set once per kernel)."""
    values = []
    for a in args:
        if a is None or isinstance(a, torch.Tensor):
            values.append(ctypes.c_void_p(a.data_ptr() if a is not None else 0))
        elif isinstance(a, bool) or not isinstance(a, (int, float)):
            raise TypeError(f"kernel argument of type {type(a).__name__}")
        elif isinstance(a, int):
            values.append(ctypes.c_int(a))
        else:
            values.append(ctypes.c_float(a))
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = shared_bytes
    if shared_bytes:   # static + dynamic past 48 KiB needs the opt-in
        _set_once(kernel, "MAX_DYNAMIC_SHARED_SIZE_BYTES", shared_bytes)
    if carveout is not None:
        _set_once(kernel, "PREFERRED_SHARED_MEMORY_CARVEOUT", carveout)
    config.hStream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    if pdl:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config.attrs = [attr]
        config.numAttrs = 1
    else:
        config.numAttrs = 0
    _check(driver.cuLaunchKernelEx(config, kernel, ctypes.addressof(pointers), 0), "cuLaunchKernelEx")
