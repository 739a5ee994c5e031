"""The pipeline executor: runs any schedule's action list for one optimizer step on this pp rank, and times it.

    executor = PipelineExecutor(chunks, "1f1b", pp_rank, pp, vpp, n_micro, mesh.group("pp"), loss_fn,
                                device, torch.float32)
    loss = executor.step(micro_batches)   # [(inputs, targets)] * n_micro; mean loss on the last stage, else None
    executor.last_timeline                # [TimedAction], seconds since the step began

Forward: global stage 0 embeds the tokens, other stages take the activation received from the
previous stage (a leaf that requires grad); the last stage backpropagates `loss_fn(logits, targets)
/ n_micro`, so the accumulated gradient is that of the mean loss. Backward runs autograd from the
stage output with the received gradient into the chunks' `.grad` (nothing else is touched: data
parallel stays outside) and yields the input gradient to send back.

Zero-bubble splits the backward (`_SplitBackward`): BI takes the input gradient alone with
`torch.autograd.grad(..., retain_graph=True)` while pre-hooks capture the gradient reaching each
graph node that feeds a weight; BW resumes autograd from those nodes (`GradientEdge`s) with
`inputs=` their parameters, so each weight-gradient matmul runs once, in BW, and nothing is
recomputed. Global stage 0 has no input gradient: its BI does nothing and its BW is the whole backward.

Messages are `P2POp`s sent with `batch_isend_irecv` on the pp group (peers by global rank), one
batch per run of consecutive communication actions; a batch is waited for when a compute needs a
tensor it receives, and the rest at the end of the step. Timing: `time.perf_counter` on CPU,
`torch.cuda.Event` pairs on GPU (read once, after the step).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from fourfold.errors import LayoutError
from fourfold.parallel.pipeline.schedules import Action, TimedAction, add_communication, build_schedule
from fourfold.parallel.pipeline.timeline import measured_bubble

__all__ = ["PipelineExecutor", "measured_bubble", "forward_only_schedule"]


def forward_only_schedule(pp: int, vpp: int, n_micro: int, rank: int) -> list[Action]:
    """Forwards only (validation): every micro-batch through chunk 0, then through chunk 1, ..."""
    computes = [[Action("F", mb, c) for c in range(vpp) for mb in range(n_micro)] for _ in range(pp)]
    return add_communication(computes, pp, vpp, rank)


class _SplitBackward:
    """Backward of one stage in two parts: input gradient now (BI), weight gradients later (BW).

    One walk of the autograd graph from `output` marks the nodes from which the stage input can be
    reached. A marked node with an edge into an unmarked subgraph is a boundary; that subgraph ends
    in the parameters it feeds (a linear's weight-gradient matmul, a norm's scale). BI runs autograd
    for the input only (the engine skips unmarked edges) while a pre-hook captures the gradient
    arriving at each boundary; BW resumes autograd at each boundary with `inputs=` its own
    parameters, so only the skipped weight branches run. When one parameter hangs below two
    boundaries (shared weights), BW instead reruns the stage's backward for the parameters.
    """

    def __init__(self, output: torch.Tensor, stage_input: torch.Tensor, params: list[torch.Tensor]):
        self.output, self.stage_input, self.params = output, stage_input, params
        target = get_gradient_edge(stage_input).node
        reaches: dict = {}
        stack = [(output.grad_fn, False)]
        while stack:  # iterative post-order walk
            node, expanded = stack.pop()
            if node is None or (node in reaches and not expanded):
                continue
            children = [n for n, _ in node.next_functions if n is not None]
            if not expanded:
                reaches[node] = False  # provisional until its children are done
                stack.append((node, True))
                stack.extend((c, False) for c in children if c not in reaches)
            else:
                reaches[node] = node is target or any(reaches[c] for c in children)
        self.branches: dict = {}  # boundary node -> parameters below its unmarked edges
        for node, hit in reaches.items():
            below = [c for c, _ in node.next_functions if c is not None and not reaches[c]] if hit else []
            if below:
                self.branches[node] = _leaf_tensors(below)
        owners = [id(p) for ps in self.branches.values() for p in ps]
        self.shared = len(owners) != len(set(owners))
        self.captured: dict = {}
        self._hooks = [] if self.shared else [n.register_prehook(self._capture(n)) for n in self.branches]
        self._grad: torch.Tensor | None = None

    def _capture(self, node):
        def hook(grad_outputs):
            """Record the gradients arriving at `node`, for the later weight backward."""
            self.captured[node] = grad_outputs
        return hook

    def input_grad(self, grad: torch.Tensor | None) -> torch.Tensor:
        """BI: d loss / d stage input, keeping the graph for BW."""
        self._grad = grad
        try:
            (g,) = torch.autograd.grad(self.output, self.stage_input, grad, retain_graph=True)
        finally:
            for h in self._hooks:
                h.remove()
        return g

    def weight_grads(self) -> None:
        """BW: accumulate the parameters' gradients into `.grad`, then drop the graph."""
        if self.shared:
            torch.autograd.backward(self.output, grad_tensors=self._grad, inputs=self.params)
        for node, grad_outputs in self.captured.items():
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(grad_outputs) if g is not None]
            if edges and self.branches[node]:
                torch.autograd.backward([e for e, _ in edges], grad_tensors=[g for _, g in edges],
                                        inputs=self.branches[node])
        self.captured.clear()
        self.branches.clear()
        self.output = self.stage_input = self._grad = None


def _leaf_tensors(nodes: list) -> list[torch.Tensor]:
    """The leaf tensors (parameters) whose AccumulateGrad nodes lie below `nodes` in the autograd graph."""
    seen, stack, leaves = set(), list(nodes), []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(n for n, _ in node.next_functions)
    return leaves


@dataclass
class _InFlight:
    """What one (micro-batch, chunk) keeps between its forward and its backward."""

    stage_input: torch.Tensor | None = None
    output: torch.Tensor | None = None  # activation sent on, or the scaled loss on the last stage
    output_grad: torch.Tensor | None = None
    split: _SplitBackward | None = None
    to_send: torch.Tensor | None = None  # the activation or input gradient waiting for its send


class PipelineExecutor:
    """Runs the `schedule_name` schedule on this pp rank's `chunks` (from split_pipeline), one step at a time.

    Optional hooks for the trainer: `autocast()` wraps each forward; `scale_loss(loss)` scales the last
    stage's loss before backward (fp16); `grad_sync(chunk_index, is_last)` returns a context entered
    around every compute on that chunk, with is_last True for micro-batch n_micro-1 (whose backward is
    the chunk's last), for data-parallel gradient synchronisation; `activation_shape` overrides the
    (micro_batch, seq, dim) shape of messages; `record_timeline=False` skips timing.
    """

    def __init__(self, chunks: list[nn.Module], schedule_name: str, pp_rank: int, pp: int, vpp: int, n_micro: int,
                 pp_group, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device,
                 dtype_of_activations: torch.dtype, *, autocast: Callable | None = None,
                 scale_loss: Callable | None = None, grad_sync: Callable | None = None,
                 activation_shape: tuple[int, ...] | None = None, record_timeline: bool = True):
        if len(chunks) != vpp:
            raise LayoutError(f"The executor got {len(chunks)} chunks but parallel.vpp is {vpp}.")
        self.chunks, self.schedule_name = chunks, schedule_name
        self.pp_rank, self.pp, self.vpp, self.n_micro = pp_rank, pp, vpp, n_micro
        self.loss_fn, self.device, self.dtype = loss_fn, torch.device(device), dtype_of_activations
        self.autocast = autocast or contextlib.nullcontext
        self.scale_loss, self.grad_sync = scale_loss, grad_sync
        self.activation_shape, self.record_timeline = activation_shape, record_timeline
        self.actions = build_schedule(schedule_name, pp, vpp, n_micro, pp_rank)
        self.eval_actions = forward_only_schedule(pp, vpp, n_micro, pp_rank)
        self.group = pp_group
        if pp > 1:
            if pp_group is None:
                raise LayoutError("A pipeline with pp > 1 needs the pp process group (mesh.group('pp')).")
            self.peers = [dist.get_global_rank(pp_group, i) for i in range(pp)]
            self._connect_neighbours()
        self.params = [[p for p in c.parameters() if p.requires_grad] for c in chunks]
        self.last_timeline: list[TimedAction] = []
        """Every action of the last step with start/end in seconds since the step began on this rank."""
        self.last_step_began = 0.0
        """Wall-clock time (time.time()) at which the last step began here; aligns ranks' timelines."""

    def _connect_neighbours(self) -> None:
        """Exchange a dummy tensor both ways with both neighbours, all pp ranks in one batch.

        NCCL connects a pair of ranks lazily, per direction, and the connecting call blocks until
        the peer connects too; a schedule's first send one way may meet a peer busy elsewhere.
        Connecting every direction up front (with all ranks in the call, NCCL's rule for a group's
        first batch_isend_irecv) keeps the step free of such waits.
        """
        prev, next_ = self.peers[(self.pp_rank - 1) % self.pp], self.peers[(self.pp_rank + 1) % self.pp]
        out = [torch.zeros(1, device=self.device) for _ in range(2)]
        into = [torch.empty(1, device=self.device) for _ in range(2)]
        ops = [dist.P2POp(dist.isend, out[0], next_, self.group), dist.P2POp(dist.irecv, into[0], prev, self.group),
               dist.P2POp(dist.isend, out[1], prev, self.group), dist.P2POp(dist.irecv, into[1], next_, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    # ----- public -------------------------------------------------------------------------------
    def step(self, micro_batches: list) -> torch.Tensor | None:
        """Forward and backward of every micro-batch ([(inputs, targets[, positions])] * n_micro).

        Gradients accumulate into the chunks' parameters; returns the mean loss (detached) on the
        rank holding the last stage, None elsewhere.
        """
        return self._run(self.actions, micro_batches, training=True)

    @torch.no_grad()
    def evaluate(self, micro_batches: list) -> torch.Tensor | None:
        """Forward-only pass (validation): mean loss on the last stage's rank, None elsewhere."""
        return self._run(self.eval_actions, micro_batches, training=False)

    # ----- the action loop ----------------------------------------------------------------------
    def _run(self, actions: list[Action], micro_batches: list, training: bool) -> torch.Tensor | None:
        if len(micro_batches) != self.n_micro:
            raise LayoutError(f"The pipeline was built for {self.n_micro} micro-batches per step, "
                              f"got {len(micro_batches)}.")
        self._batches = micro_batches
        self._flight: dict[tuple[int, int], _InFlight] = {}
        self._received: dict[tuple[str, int, int], tuple[_Batch, torch.Tensor]] = {}
        self._posted: list[_Batch] = []
        self._loss_sum: torch.Tensor | None = None
        self._clock = _Clock(self.device, self.record_timeline)
        self.last_step_began = time.time()
        self._marks: list[tuple[Action, object, object]] = []
        i = 0
        while i < len(actions):
            if actions[i].is_comm:
                j = i
                while j < len(actions) and actions[j].is_comm:
                    j += 1
                self._post(actions[i:j])
                i = j
            else:
                self._compute(actions[i], training)
                i += 1
        for batch in self._posted:  # the sends still in flight
            batch.wait()
        self.last_timeline = self._clock.resolve(self._marks)
        if self._flight or self._received:
            raise RuntimeError(f"pipeline step left work behind: {list(self._flight)} {list(self._received)}")
        if self._loss_sum is None:
            return None
        return self._loss_sum / self.n_micro

    def _stage(self, a: Action) -> int:
        return a.chunk * self.pp + self.pp_rank

    def _shape(self) -> tuple[int, ...]:
        if self.activation_shape is not None:
            return tuple(self.activation_shape)
        inputs = self._batches[0][0]
        return (*inputs.shape[:2], self.chunks[0].cfg.dim)

    def _post(self, comms: list[Action]) -> None:
        ops, receives, sends = [], [], []
        for a in comms:
            peer = self.peers[a.peer]
            if a.kind.startswith("RECV"):
                buf = torch.empty(self._shape(), dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buf, peer, self.group))
                receives.append((a, buf))
            else:
                state = self._flight[(a.microbatch, a.chunk)]
                tensor, state.to_send = state.to_send, None
                ops.append(dist.P2POp(dist.isend, tensor, peer, self.group))
                sends.append((a, tensor))
        begin = self._clock.mark()
        marks = range(len(self._marks), len(self._marks) + len(ops))
        batch = _Batch(dist.batch_isend_irecv(ops), [t for _, t in sends], marks, self)
        self._posted.append(batch)
        for a, buf in receives:
            self._received[(a.kind[-1], a.microbatch, a.chunk)] = (batch, buf)
        for a, _ in receives + sends:
            self._marks.append((a, begin, None))
        for a, _ in sends:
            self._release(a)

    def _take(self, kind: str, mb: int, chunk: int) -> torch.Tensor:
        batch, buf = self._received.pop((kind, mb, chunk))
        batch.wait()
        return buf

    def _release(self, a: Action) -> None:
        state = self._flight.get((a.microbatch, a.chunk))
        if state is not None and state.output is None and state.to_send is None and state.split is None:
            del self._flight[(a.microbatch, a.chunk)]

    def _sync(self, a: Action):
        if self.grad_sync is None:
            return contextlib.nullcontext()
        return self.grad_sync(a.chunk, a.microbatch == self.n_micro - 1)

    def _compute(self, a: Action, training: bool) -> None:
        """Wait for the tensor this action consumes (if received), then run and time it."""
        stage, last = self._stage(a), self.pp * self.vpp - 1
        received = None
        if a.kind == "F" and stage > 0:
            received = self._take("F", a.microbatch, a.chunk)
        elif a.kind in ("B", "BI") and stage < last:
            received = self._take("B", a.microbatch, a.chunk)
        begin = self._clock.mark()
        with self._sync(a):
            if a.kind == "F":
                self._forward(a, received, training)
            elif a.kind in ("B", "BI"):
                self._backward(a, received, split=a.kind == "BI")
            else:
                self._backward_weights(a)
        self._marks.append((a, begin, self._clock.mark()))

    def _forward(self, a: Action, received: torch.Tensor | None, training: bool) -> None:
        stage, last = self._stage(a), self.pp * self.vpp - 1
        batch = self._batches[a.microbatch]
        positions = batch[2].to(self.device) if len(batch) > 2 and batch[2] is not None else None
        state = _InFlight()
        if stage == 0:
            x = batch[0].to(self.device, non_blocking=True)
        else:
            x = received
            if training:
                x.requires_grad_()
            state.stage_input = x
        with self.autocast():
            out = self.chunks[a.chunk](x, positions)
        if stage == last:
            loss = self.loss_fn(out, batch[1].to(self.device, non_blocking=True))
            detached = loss.detach()
            self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
            if training:
                scaled = loss / self.n_micro
                state.output = self.scale_loss(scaled) if self.scale_loss is not None else scaled
        else:
            state.to_send = out.detach().to(self.dtype).contiguous()
            if training:
                state.output = out
        if training or stage != last:
            self._flight[(a.microbatch, a.chunk)] = state

    def _backward(self, a: Action, received: torch.Tensor | None, split: bool) -> None:
        state = self._flight[(a.microbatch, a.chunk)]
        stage = self._stage(a)
        grad = None if received is None else received.to(state.output.dtype)
        if split:
            state.output_grad = grad
            if stage > 0:
                state.split = _SplitBackward(state.output, state.stage_input, self.params[a.chunk])
                state.to_send = state.split.input_grad(grad).to(self.dtype).contiguous()
            return
        torch.autograd.backward(state.output, grad_tensors=grad)
        state.output = None
        if stage > 0:
            state.to_send = state.stage_input.grad.to(self.dtype).contiguous()
            state.stage_input = None
        else:
            del self._flight[(a.microbatch, a.chunk)]

    def _backward_weights(self, a: Action) -> None:
        state = self._flight[(a.microbatch, a.chunk)]
        if state.split is None:  # global stage 0: no input gradient was taken, run the whole backward
            torch.autograd.backward(state.output, grad_tensors=state.output_grad, inputs=self.params[a.chunk])
        else:
            state.split.weight_grads()
        state.output = state.output_grad = state.split = state.stage_input = None
        self._release(a)


class _Batch:
    """One batch_isend_irecv: its works are waited for once (gloo hangs on a second wait of a receive)."""

    def __init__(self, works: list, keep_alive: list[torch.Tensor], marks: range, executor: PipelineExecutor):
        self.works, self.keep_alive, self.marks, self.executor = works, keep_alive, marks, executor
        self.done = False

    def wait(self) -> None:
        """Wait for every message of the batch (the executor's compute then sees received data)."""
        if self.done:
            return
        for w in self.works:
            w.wait()
        self.done, self.keep_alive = True, []
        end = self.executor._clock.mark()
        for i in self.marks:
            a, begin, _ = self.executor._marks[i]
            self.executor._marks[i] = (a, begin, end)


class _Clock:
    """Marks points in time: perf_counter on CPU, CUDA events on GPU (read once, in `resolve`)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.origin = self.mark(force=True)

    def mark(self, force: bool = False):
        """The current time (a recorded CUDA event, or perf_counter seconds); None when timing is off and not forced."""
        if not (self.enabled or force):
            return None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, mark) -> float:
        """Seconds from the clock's origin to `mark`."""
        if self.cuda:
            return self.origin.elapsed_time(mark) / 1000.0
        return mark - self.origin

    def resolve(self, marks: list[tuple[Action, object, object]]) -> list[TimedAction]:
        """Turn (action, begin mark, end mark) into TimedActions in seconds since the step began."""
        if not self.enabled:
            return []
        if self.cuda:
            torch.cuda.synchronize()
        return [TimedAction(a, self.seconds(b), self.seconds(e if e is not None else b)) for a, b, e in marks]
