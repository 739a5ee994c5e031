import torch
from fourfold.quant import int4_gemm
from fourfold.quant.packing import pack_int4
for meth in ("join", "split", "dequant"):
    for m, n, k, asym in ((64, 2048, 2048, False), (300, 2560, 5632, True), (7, 11264, 2048, True)):
        q = torch.randint(-8, 8, (n, k)); s = torch.rand(n, k // 128) * 0.01 + 0.01
        z = torch.randint(-8, 8, (n, k // 128), dtype=torch.int8) if asym else torch.zeros(n, k // 128, dtype=torch.int8)
        w = (q - z.float().repeat_interleave(128, 1)) * s.repeat_interleave(128, 1)
        x = torch.randn(m, k).bfloat16()
        y = int4_gemm.int4_gemm(x.cuda(), pack_int4(q + 8).cuda(), s.bfloat16().cuda(), z.cuda(), 128, asym=asym, method=meth)
        ref = x.float() @ w.T
        e = float((y.float().cpu() - ref).norm() / ref.norm()); print("smoke", meth, m, n, k, asym, e); assert e < 1e-2
