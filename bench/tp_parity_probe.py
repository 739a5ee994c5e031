"""Find where tensor parallel first departs from one device: step-0 logits, loss and every parameter gradient.

    torchrun --standalone --nproc-per-node 2 bench/tp_parity_probe.py --device cuda [--no-sp]

Written to locate the NCCL tp2 parity gap in docs/benchmarks.md (torch 2.11 stepped on unreduced
sequence-parallel norm gradients; fixed by `settle_partial_grads`). Every rank builds the same float64
model from one seed; rank 0 also runs it whole on its device as the reference. The tp copy is sharded
with `apply_tensor_parallel`, runs the same batch through the vocab-parallel loss, and its gradients are
settled as the trainer settles them. Compared per parameter is what the optimizer will read: the local
gradient of a replicated parameter, the gathered gradient of a sharded one. Rank 0 prints the logits and
loss differences and the parameters ordered by gradient difference, so the first module that differs
stands out.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


def main() -> None:
    """Compare one forward/backward of a tp-sharded model with the same model on one device."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from fourfold.config import ModelConfig
    from fourfold.models.llama import Llama
    from fourfold.parallel.tensor import apply_tensor_parallel, compute_loss, loss_context, settle_partial_grads

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-sp", action="store_true", help="tensor parallel without sequence parallel")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()

    cuda = args.device == "cuda"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=64)
    torch.manual_seed(0)
    base = Llama(cfg).double()
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    ref = copy.deepcopy(base).to(device)
    ref_logits = ref(inputs)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()

    tp = apply_tensor_parallel(copy.deepcopy(base).to(device), mesh["tp"], sequence_parallel=not args.no_sp)
    with loss_context(True):
        logits = tp(inputs)
        loss = compute_loss(logits, targets)
        loss.backward()
    full_logits = logits.full_tensor()
    settle_partial_grads(tp.parameters())

    def as_read(grad):
        """The gradient as the optimizer reads it: a replicated DTensor's local tensor, a shard gathered."""
        if not hasattr(grad, "placements"):
            return grad
        return grad.to_local() if all(pl.is_replicate() for pl in grad.placements) else grad.full_tensor()

    grads = {n: as_read(p.grad) for n, p in tp.named_parameters()}
    if rank == 0:
        print(f"device {device}, tp={world}, sequence parallel {not args.no_sp}, torch {torch.__version__}")
        print(f"max |logits diff| {float((full_logits - ref_logits).detach().abs().max()):.3e}")
        print(f"|loss diff|       {abs(float(loss.full_tensor()) - float(ref_loss)):.3e}")
        diffs = []
        for name, p in ref.named_parameters():
            scale = float(p.grad.abs().max()) or 1.0
            diffs.append((float((grads[name] - p.grad).abs().max()) / scale, name))
        print(f"largest relative gradient differences (of {len(diffs)} parameters):")
        for d, name in sorted(diffs, reverse=True)[:args.top]:
            print(f"  {d:.3e}  {name}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
