"""The floor of a decode GEMV on one GPU: how fast a dependent kernel can merely read its weight's bytes.

    python bench/read_floor.py --out DIR     # one H200; writes read_floor.json, prints a table

A one-row decode GEMV must at least read its weight once, in a kernel that waits for the one before it. This
times exactly that and nothing more, three ways (CUDA C++ through fourfold.ops.nvrtc_launch, launched with
programmatic dependent launch like fourfold's decode kernels; each XORs what it reads and stores nothing but one
impossible word, so no load can be dropped):
- `stream_read`: 16-byte loads into registers, U in flight a thread; threads a block (256/512/1024), blocks an SM
  (1/2/4), U (4/8), the first loads before griddepcontrol.wait or after (EARLY), grid-strided or block chunks;
- `stream_async`: 16-byte cp.async copies into a ring of U shared-memory slots a thread (U 4/8/16), EARLY or not;
- `stream_bulk`: the bulk copy engine (cp.async.bulk with mbarriers), 8/16 KiB pieces through 4/8 stages a block.
Each case is a CUDA graph of back-to-back launches over copies of the buffer (more bytes than L2 holds), replayed
30 times (bench/gemv_check.graph_us); the best config per size is reported. Sizes: the bytes of the int4-g128
weights (nibbles + bf16 scales and zero points) and of the bf16 weights of llama-1b's and llama3-8b's decode
matmuls. Beside them, in the same run, the engine's one-row int4 GEMVs (Int4WeightLinear.decode) and cuBLAS bf16
(F.linear) on those shapes, then per llama-1b layer: the four register reads chained at their best configs against
the engine's four int4 GEMVs with fused norms. So each engine kernel's time reads against the time to move its
bytes at all.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_check import copies_for, graph_us  # noqa: E402
from int4_gemv_check import DEV, module  # noqa: E402
from int4_mma_check import engine_layer, preset_shapes  # noqa: E402

from fourfold.ops import nvrtc_launch  # noqa: E402

SOURCE = r"""
typedef unsigned int u32;

__device__ __forceinline__ uint4 load_v4(const uint4* p) {   // volatile: loads before the wait stay there
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

extern "C" __global__ void __launch_bounds__(THREADS) stream_read(const uint4* __restrict__ src, int n_vec, u32* out) {
    asm volatile("griddepcontrol.launch_dependents;");
#if CHUNKED   // block b reads vectors [b * per_block, (b + 1) * per_block), its threads strided by THREADS
    const int per_block = (n_vec + gridDim.x - 1) / gridDim.x;
    int i = blockIdx.x * per_block + threadIdx.x;
    const int end = min(n_vec, (int)(blockIdx.x + 1) * per_block), stride = THREADS;
#else         // grid-strided
    int i = blockIdx.x * THREADS + threadIdx.x;
    const int end = n_vec, stride = gridDim.x * THREADS;
#endif
    uint4 r[U];
    u32 acc = 0;
#if EARLY
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = i + u * stride < end ? load_v4(src + i + u * stride) : make_uint4(0, 0, 0, 0);
    asm volatile("griddepcontrol.wait;" ::: "memory");
#else
    asm volatile("griddepcontrol.wait;" ::: "memory");
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = i + u * stride < end ? load_v4(src + i + u * stride) : make_uint4(0, 0, 0, 0);
#endif
    while (true) {
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
        i += U * stride;
        if (i >= end) break;
#pragma unroll
        for (int u = 0; u < U; ++u) r[u] = i + u * stride < end ? load_v4(src + i + u * stride) : make_uint4(0, 0, 0, 0);
    }
    if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;   // keeps every load live; practically never taken
}

// the same reads through shared memory: each thread a ring of U 16-byte cp.async slots, one commit group a slot
extern "C" __global__ void __launch_bounds__(THREADS) stream_async(const uint4* __restrict__ src, int n_vec, u32* out) {
    asm volatile("griddepcontrol.launch_dependents;");
    extern __shared__ uint4 ring[];
    uint4* own = ring + threadIdx.x;
    int i = blockIdx.x * THREADS + threadIdx.x;
    const int stride = gridDim.x * THREADS;
    int next = i;
#if !EARLY
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (next < n_vec)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                         :: "r"((u32)__cvta_generic_to_shared(own + u * THREADS)), "l"(src + next) : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
        next += stride;
    }
#if EARLY
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    u32 acc = 0;
    for (int slot = 0; i < n_vec; i += stride, slot = (slot + 1) & (U - 1)) {
        asm volatile("cp.async.wait_group %0;" :: "n"(U - 1) : "memory");
        const uint4 r = own[slot * THREADS];
        acc ^= r.x ^ r.y ^ r.z ^ r.w;
        if (next < n_vec)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                         :: "r"((u32)__cvta_generic_to_shared(own + slot * THREADS)), "l"(src + next) : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
        next += stride;
    }
    if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}

// the same reads by the bulk copy engine (TMA, cp.async.bulk): a block's contiguous share in CHUNK-byte pieces
// through STAGES shared-memory stages, each with an mbarrier; thread 0 issues, every thread reads its part
extern "C" __global__ void __launch_bounds__(THREADS) stream_bulk(const uint4* __restrict__ src, int n_vec, u32* out) {
    asm volatile("griddepcontrol.launch_dependents;");
    extern __shared__ uint4 stages[];
    __shared__ unsigned long long bars[STAGES];
    constexpr int VEC = CHUNK / 16;
    const int chunks = (n_vec + VEC - 1) / VEC;
    const int c0 = blockIdx.x * chunks / gridDim.x, c1 = (blockIdx.x + 1) * chunks / gridDim.x;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"((u32)__cvta_generic_to_shared(bars + s)));
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int c) {
        const int s = (c - c0) % STAGES;
        const int bytes = min(VEC, n_vec - c * VEC) * 16;
        const u32 bar = (u32)__cvta_generic_to_shared(bars + s);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"((u32)__cvta_generic_to_shared(stages + s * VEC)), "l"(src + (size_t)c * VEC), "r"(bytes),
                        "r"(bar) : "memory");
    };
#if !EARLY
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (threadIdx.x == 0)
        for (int c = c0; c < min(c1, c0 + STAGES); ++c) issue(c);
#if EARLY
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    u32 acc = 0;
    for (int c = c0; c < c1; ++c) {
        const int s = (c - c0) % STAGES;
        const u32 parity = ((c - c0) / STAGES) & 1;
        const u32 bar = (u32)__cvta_generic_to_shared(bars + s);
        u32 done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(bar), "r"(parity) : "memory");
        const int vecs = min(VEC, n_vec - c * VEC);
        for (int v = threadIdx.x; v < vecs; v += THREADS) {
            const uint4 r = stages[s * VEC + v];
            acc ^= r.x ^ r.y ^ r.z ^ r.w;
        }
        __syncthreads();   // the stage is read: it may be refilled
        if (threadIdx.x == 0 && c + STAGES < c1) {
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            issue(c + STAGES);
        }
    }
    if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;
}
"""

ASYNC_CONFIGS = [dict(THREADS=t, BPS=b, U=u, EARLY=e) for t in (256, 512, 1024) for b in (1, 2) if t * b <= 2048
                 for u in (4, 8, 16) if t * b * u * 16 <= 200 * 1024 for e in (0, 1)]
BULK_CONFIGS = [dict(THREADS=t, BPS=b, STAGES=s, CHUNK=c, EARLY=e) for t in (256, 512) for b in (1, 2)
                for s in (4, 8) for c in (8192, 16384) if b * s * c <= 200 * 1024 for e in (0, 1)]

CONFIGS = [dict(THREADS=t, BPS=b, U=u, EARLY=e, CHUNKED=c)
           for t in (256, 512, 1024) for b in (1, 2, 4) if t * b <= 2048
           for u in (4, 8) for e in (0, 1) for c in (0, 1)]


def int4_bytes(n: int, k: int, group: int = 128) -> int:
    return n * k // 2 + n * (k // group) * 4     # nibbles, bf16 scales and bf16 zero points


KERNELS = {"stream_read": CONFIGS, "stream_async": ASYNC_CONFIGS, "stream_bulk": BULK_CONFIGS}


def read_calls(nbytes: int, cfg: dict, sms: int, buffers: list, sink: torch.Tensor, name: str = "stream_read") -> list:
    defines = {key: val for key, val in cfg.items() if key not in ("BPS", "PAD")}
    defines = {"CHUNKED": 0, "U": 1, "STAGES": 1, "CHUNK": 16, **defines}
    kernel = nvrtc_launch.compiled_kernel(SOURCE, name, defines, DEV)
    shared = {"stream_read": 0, "stream_async": cfg["THREADS"] * defines["U"] * 16,
              "stream_bulk": defines["STAGES"] * defines["CHUNK"]}[name] + cfg.get("PAD", 0)
    n_vec = nbytes // 16
    return [lambda b=b: nvrtc_launch.launch(kernel, sms * cfg["BPS"], cfg["THREADS"], [b, n_vec, sink], DEV, pdl=True,
                                            shared_bytes=shared) for b in buffers]


def best_read(nbytes: int, sms: int, sink: torch.Tensor, name: str = "stream_read") -> tuple[float, dict, list]:
    buffers = [torch.empty(nbytes // 16 * 16, device=DEV, dtype=torch.uint8).random_(0, 256)
               for _ in range(copies_for(nbytes))]
    configs = KERNELS[name]
    timed = sorted(((graph_us(read_calls(nbytes, cfg, sms, buffers, sink, name)), i) for i, cfg in enumerate(configs)))
    del buffers
    torch.cuda.empty_cache()
    return timed[0][0], configs[timed[0][1]], [(us, configs[i]) for us, i in timed[:3]]


def shape_rows(preset: str, sms: int, sink: torch.Tensor, results: list) -> dict:
    best = {}
    for name, (n, k) in preset_shapes(preset).items():
        gated = name == "gate_up"
        row = {"preset": preset, "shape": name, "n": n, "k": k, "int4_bytes": int4_bytes(n, k), "bf16_bytes": n * k * 2}
        row["read_int4_us"], best[name], row["read_int4_top3"] = best_read(row["int4_bytes"], sms, sink)
        row["read_bf16_us"], _, row["read_bf16_top3"] = best_read(row["bf16_bytes"], sms, sink)
        for mech in ("stream_async", "stream_bulk"):   # the same int4 bytes through shared memory
            row[f"{mech}_int4_us"], _, row[f"{mech}_int4_top3"] = best_read(row["int4_bytes"], sms, sink, mech)
        copies = copies_for(row["int4_bytes"])
        mods = [module(n, k, "int4-g128")[0] for _ in range(copies)]
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        row["engine_int4_us"] = graph_us([lambda m=m: m.decode(x, gated=gated) for m in mods])
        del mods
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies_for(row["bf16_bytes"]))]
        row["cublas_bf16_us"] = graph_us([lambda w=w: F.linear(x, w) for w in ws])
        del ws
        torch.cuda.empty_cache()
        for kind in ("int4", "bf16"):
            row[f"read_{kind}_tbs"] = row[f"{kind}_bytes"] / row[f"read_{kind}_us"] / 1e6
        print(f"{preset:9s} {name:8s} int4 {row['int4_bytes'] / 1e6:6.2f} MB: read {row['read_int4_us']:6.2f} us "
              f"({row['read_int4_tbs']:.2f} TB/s), engine GEMV {row['engine_int4_us']:6.2f} | bf16 "
              f"{row['bf16_bytes'] / 1e6:6.1f} MB: read {row['read_bf16_us']:6.2f} ({row['read_bf16_tbs']:.2f} TB/s), "
              f"cuBLAS {row['cublas_bf16_us']:6.2f} | best int4 read config {best[name]} | int4 through cp.async "
              f"{row['stream_async_int4_us']:.2f} ({row['stream_async_int4_top3'][0][1]}), bulk "
              f"{row['stream_bulk_int4_us']:.2f} ({row['stream_bulk_int4_top3'][0][1]})")
        results.append(row)
    return best


def layer_row(sms: int, sink: torch.Tensor, best: dict, results: list, layers: int = 12) -> None:
    shapes = preset_shapes("llama-1b")
    dim = shapes["o"][0]
    buffers = [{nm: torch.empty(int4_bytes(n, k), device=DEV, dtype=torch.uint8) for nm, (n, k) in shapes.items()}
               for _ in range(layers)]
    calls = []
    for L in buffers:
        for nm, (n, k) in shapes.items():
            calls += read_calls(int4_bytes(n, k), best[nm], sms, [L[nm]], sink)
    reads = graph_us(calls) * len(calls) / layers
    mods = [{nm: module(n, k, "int4-g128")[0] for nm, (n, k) in shapes.items()} for _ in range(layers)]
    nw = torch.ones(dim, device=DEV, dtype=torch.bfloat16)
    x0 = torch.randn(1, dim, device=DEV, dtype=torch.bfloat16)
    att = torch.randn(1, dim, device=DEV, dtype=torch.bfloat16)


    engine = graph_us([lambda L=L: engine_layer(L, x0, att, nw) for L in mods])
    results.append({"layer": "llama-1b", "reads_us": reads, "engine_int4_us": engine})
    print(f"llama-1b layer at one row: four reads {reads:.2f} us, the engine's four int4 GEMVs {engine:.2f} us")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/read-floor")
    p.add_argument("--presets", default="llama-1b,llama3-8b")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    sink = torch.zeros(4 * sms, device=DEV, dtype=torch.int32)
    results: list = []
    best = {}
    for preset in args.presets.split(","):
        found = shape_rows(preset, sms, sink, results)
        best = found if preset == "llama-1b" else best
    if best:
        layer_row(sms, sink, best, results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "read_floor.json").write_text(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                                                     "sms": sms, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
