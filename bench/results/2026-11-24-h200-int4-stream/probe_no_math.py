"""Session probe, 2026-11-24 (kept with its results, run from the repository root as bench/_probe_stream.py): pure cp.async reads with and without room for a second block, and the streaming GEMV with its sums switched off (NO_MATH)."""
import sys, json
sys.path.insert(0, 'bench'); sys.path.insert(0, '.')
import torch
from read_floor import read_calls, int4_bytes, DEV
from gemv_check import copies_for, graph_us
from int4_gemv_check import module
from int4_mma_check import preset_shapes
from fourfold.quant import int4_stream
out = {}
sms = torch.cuda.get_device_properties(DEV).multi_processor_count
sink = torch.zeros(4 * sms, device=DEV, dtype=torch.int32)
for preset in ("llama-1b", "llama3-8b"):
    for name, (n, k) in preset_shapes(preset).items():
        nb = int4_bytes(n, k)
        bufs = [torch.empty(nb // 16 * 16, device=DEV, dtype=torch.uint8) for _ in range(copies_for(nb))]
        for th, u in ((1024, 4), (512, 8), (512, 4)):
            for pad in (0, 60_000, 120_000):
                for early in (0, 1):
                    cfg = dict(THREADS=th, BPS=1, U=u, EARLY=early, PAD=pad)
                    us = graph_us(read_calls(nb, cfg, sms, bufs, sink, "stream_async"))
                    out[f"{preset} {name} async t{th} u{u} pad{pad} early{early}"] = us
        del bufs
        gated = name == "gate_up"
        mods = [module(n, k, "int4-g128")[0] for _ in range(copies_for(nb))]
        x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
        packed = [m.mma_words() for m in mods]
        for warps in (4, 8, 16):
            for ring in (2, 4, 8, 16):
                cfg = int4_stream.stream_config(k, 128, gated, warps=warps, ring=ring)
                if int4_stream.shared_bytes(cfg[0], cfg[1], k, gated) > 110_000 and warps < 16:
                    continue
                for nomath in (0, 1):
                    for bps in (1, 2):
                        try:
                            us = graph_us([lambda p=p: int4_stream.int4_stream_gemv(x, p[0], p[1], 128, gated=gated,
                                  launch_config=cfg, grid=sms * bps, probe={"NO_MATH": nomath}) for p in packed])
                        except Exception as e:
                            continue
                        out[f"{preset} {name} stream w{warps} r{ring} b{bps} nomath{nomath}"] = us
        del mods, packed
        torch.cuda.empty_cache()
        for key, v in out.items():
            if key.startswith(f"{preset} {name} "):
                print(key, round(v, 2))
import os
json.dump(out, open(os.environ["OUT"] + "/probe.json", "w"), indent=1)
