"""Step runners: one interface (`step`, `evaluate`) for every layout, and the factory that picks one.

    runner = build_runner(cfg, mesh, dp, chunks, device)
    loss, grad_norm, skipped = runner.step(micro_batches)

`PlainRunner` (runner/plain.py) runs the one model chunk of a rank without pipeline parallel;
`PipelineRunner` (runner/pipeline.py) runs this rank's stages through the pipeline executor. The
interface and what both share live in runner/base.py.
"""

from fourfold.config import Config
from fourfold.mesh import ParallelMesh
from fourfold.parallel.data_parallel import DataParallel
from fourfold.train.runner.base import RunReport, StepResult, StepRunner, as_plain_tensor
from fourfold.train.runner.pipeline import PipelineRunner, stage_activation_shape
from fourfold.train.runner.plain import PlainRunner

__all__ = ["PipelineRunner", "PlainRunner", "RunReport", "StepResult", "StepRunner", "as_plain_tensor",
           "build_runner", "runner_class", "stage_activation_shape"]


def runner_class(mesh: ParallelMesh) -> type[StepRunner]:
    """The kind of runner a layout needs: the pipeline runner when the mesh has pipeline stages, else the plain one."""
    return PipelineRunner if mesh.size("pp") > 1 else PlainRunner


def build_runner(cfg: Config, mesh: ParallelMesh, dp: DataParallel, chunks: list, device) -> StepRunner:
    """This rank's runner over its model `chunks` (from fourfold.parallel.build.build_model)."""
    return runner_class(mesh)(cfg, mesh, dp, chunks, device)
