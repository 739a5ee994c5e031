"""Hugging Face export and import time for a preset, next to transformers' own load of the exported directory.

    python bench/hf_convert.py --preset llama-1b --dir /tmp/hfconv --json bench/results/hf_convert.json

Builds the preset with random bf16 weights, writes it as a consolidated fourfold model, then times
`export_hf` (fourfold -> Hugging Face directory), `import_hf` (back to fourfold) and, as the peer,
`LlamaForCausalLM.from_pretrained` of the exported directory; all on the host, one process.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from fourfold.checkpoint.consolidated import write_consolidated  # noqa: E402
from fourfold.checkpoint.hf_export import export_hf  # noqa: E402
from fourfold.checkpoint.hf_import import import_hf  # noqa: E402
from fourfold.config import build_config  # noqa: E402
from fourfold.models.llama import Llama  # noqa: E402


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--dir", default="/tmp/fourfold-hf-convert")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    cfg = build_config({"model": {"preset": args.preset}})
    with torch.device("meta"):
        model = Llama(cfg.model)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    write_consolidated(root / "fourfold", cfg.to_dict(), tensors)
    del model, tensors
    result = {"preset": args.preset, "weight_bytes": nbytes,
              "export_s": timed(lambda: export_hf(root / "fourfold", root / "hf")),
              "import_s": timed(lambda: import_hf(root / "hf", root / "back"))}
    from transformers import LlamaForCausalLM

    result["transformers_from_pretrained_s"] = timed(lambda: LlamaForCausalLM.from_pretrained(
        root / "hf", torch_dtype=torch.bfloat16))
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
