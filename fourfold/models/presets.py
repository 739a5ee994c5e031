"""Named model shapes: `model.preset = "llama3-8b"` fills the model config from one of these.

Shapes follow the published model cards; `tiny` is ours, sized to train in minutes on two CPU cores.
"""

from __future__ import annotations

LLAMA3_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 8192}

PRESETS: dict[str, dict] = {
    # Trains on CPU in a few minutes with the byte tokenizer (257 ids, padded to 320 so tp up to 64 divides).
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=320,
                 max_seq_len=256, rope_theta=10000.0),
    # TinyLlama-1.1B shape.
    "llama-1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, vocab_size=32000,
                     max_seq_len=2048, rope_theta=10000.0),
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                      max_seq_len=8192, rope_theta=500000.0, rope_scaling=None),
    "llama3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256,
                       max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256,
                        max_seq_len=8192, rope_theta=500000.0),
    # Llama 3.1 8B: the 3-8B shape with 128k context through Llama-3 frequency scaling.
    "llama3.1-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                        max_seq_len=131072, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE_SCALING),
}
