"""checkpoint.init_from on a Hugging Face model, imported with `fourfold convert` (hf_import) or given as the
Hugging Face directory itself: the trainer takes the model's shape from it (no [model] keys given) and starts
from its weights, with the logits of transformers' own model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fourfold.checkpoint.hf_import import import_hf
from fourfold.config import ModelConfig
from fourfold.train.trainer import Trainer
from tests.trainer_helpers import tiny_config

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("source", ["imported", "hf directory"])
def test_training_starts_from_a_hugging_face_model(tmp_path, source):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)).float().eval()
    hf.save_pretrained(tmp_path / "hf")
    init = import_hf(tmp_path / "hf", tmp_path / "imported") if source == "imported" else tmp_path / "hf"
    cfg = tiny_config(tmp_path, **{"train.steps": 1, "compute.precision": "fp32"})
    cfg = dataclasses.replace(cfg, model=ModelConfig(),  # no [model] keys: the shape comes from the checkpoint
                              checkpoint=dataclasses.replace(cfg.checkpoint, init_from=str(init)))
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.cfg.model.dim == 64 and trainer.cfg.model.n_layers == 2
    model = trainer.runner.checkpoint_modules.eval()
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    summary = trainer.run()
    assert summary.steps == 1 and summary.first_loss is not None
