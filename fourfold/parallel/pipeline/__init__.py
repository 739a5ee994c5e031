"""Pipeline parallelism in one import: split the model into stages, run a schedule, measure and draw it.

    from fourfold.parallel.pipeline import split_pipeline, PipelineExecutor, measured_bubble
    chunks = split_pipeline(model, pp_rank, pp, vpp, cfg.parallel.pp_layers)      # this rank's stages
    chunks = build_model(cfg.model, cfg.parallel, cfg.compute, cfg.quant, mesh, dp, device)  # does both: split, TP / FSDP
    executor = PipelineExecutor(chunks, cfg.parallel.pp_schedule, pp_rank, pp, vpp, n_micro,
                                mesh.group("pp"), loss_fn, device, activation_dtype)
    loss = executor.step(micro_batches)        # last stage: mean loss; other ranks: None
    draw_timeline(gathered_timelines, run_dir / "pp_timeline.png", "1f1b")

The pieces live beside this file: schedules.py (action lists, analytic bubble, simulator),
split.py (stages), executor.py (the executor) and timeline.py (bubble, trace, picture). The trainer
drives the executor through `fourfold.train.runner.PipelineRunner`.
"""

from fourfold.parallel.pipeline.executor import PipelineExecutor, forward_only_schedule
from fourfold.parallel.pipeline.split import split_pipeline, stage_layer_counts, stage_layers
from fourfold.parallel.pipeline.schedules import (SCHEDULES, Action, TimedAction, analytic_bubble, build_schedule,
                                         simulate)
from fourfold.parallel.pipeline.timeline import draw_timeline, measured_bubble, pipeline_bubble, write_chrome_trace

__all__ = [
    "Action", "PipelineExecutor", "SCHEDULES", "TimedAction", "analytic_bubble", "build_schedule",
    "draw_timeline", "forward_only_schedule", "measured_bubble", "pipeline_bubble", "simulate",
    "split_pipeline", "stage_layer_counts", "stage_layers", "write_chrome_trace",
]
