"""One training iteration, as train.py runs it and benchmarks/bench_train.py times it: the micro-steps' forward and
backward with gradient accumulation, the gradient clip and the optimizer step.

    step = TrainStep(model, optimizer, scaler, dtype="bfloat16", accum_steps=4, grad_clip=1.0)
    loss = step(batches)   # batches: the iteration's accum_steps (x, y) pairs, drawn as they are needed

`model` is what the micro-steps run through: the GPT itself (compiled in place by `compile_model`, or not), or it
wrapped in DDP. With cuda_graphs=True each micro-step is replayed from a CUDA graph (GraphedMicroStep) instead of
launched op by op.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Iterable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

if TYPE_CHECKING:
    from model import GPT

PTDTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_context(dtype: str, device_type: str, cache_enabled: bool = True):
    """Mixed precision for `dtype` ("float32": none): the weights stay fp32, matmuls run in bf16 or fp16."""
    if PTDTYPES[dtype] == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=PTDTYPES[dtype], cache_enabled=cache_enabled)


def compile_model(model: GPT, **options) -> GPT:
    """torch.compile applied region by region, in place: each transformer block, and the output head
    (GPT.logits_and_loss). The blocks are alike, so they share one compiled graph and compiling costs one block's
    time whatever n_layer is (a whole-model compile traces and lowers every layer), while each region still fuses
    what matters: the norms, GELU and residual adds around the matmuls and our kernels (on a GPU the attention,
    RoPE and the loss head's kernels are custom ops in these graphs). fullgraph=True: a graph break around our
    attention ops is an error here, not a silent slowdown. The state_dict keeps its keys. `options` go to
    torch.compile (backend, mode)."""
    for block in model.transformer.h:
        block.compile(fullgraph=True, **options)
    model.logits_and_loss = torch.compile(model.logits_and_loss, fullgraph=True, **options)
    return model


class TrainStep:
    """One optimizer step over a global batch: each micro-step's loss is divided by accum_steps and its scaled
    backward adds into .grad (DDP all-reduces the gradients on the last micro-step only), then the gradients are
    unscaled and clipped (grad_clip > 0), the optimizer steps and the gradients are zeroed. The learning rate is the
    caller's to set beforehand. It returns the mean of this rank's micro-step losses, on the device (no sync)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        *,
        dtype: str,
        accum_steps: int,
        grad_clip: float,
        cuda_graphs: bool = False,
    ):
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.dtype, self.accum_steps, self.grad_clip, self.cuda_graphs = dtype, accum_steps, grad_clip, cuda_graphs
        self.device = next(model.parameters()).device
        self.ctx = autocast_context(dtype, self.device.type)
        self.graphed: GraphedMicroStep | None = None  # built at the first micro-step when cuda_graphs=True

    def __call__(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        mean_loss = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            mean_loss += self._micro_step(x, y, sync=i == self.accum_steps - 1)
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=not self.cuda_graphs)  # a captured backward keeps its .grad tensors
        return mean_loss

    def _micro_step(self, x: torch.Tensor, y: torch.Tensor, sync: bool) -> torch.Tensor:
        if self.cuda_graphs:  # the same micro-step, replayed from a CUDA graph (one process, no DDP)
            if self.graphed is None:
                self.graphed = GraphedMicroStep(self.model, self.dtype, self.scaler, self.accum_steps, x, y)
            return self.graphed(x, y)
        return micro_step(self.model, x, y, self.ctx, self.scaler, self.accum_steps, sync=sync)


def micro_step(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    ctx,
    scaler: torch.amp.GradScaler,
    accum_steps: int,
    *,
    sync: bool = True,
) -> torch.Tensor:
    """One micro-step, run eagerly and captured by GraphedMicroStep alike: the forward under ctx, loss / accum_steps
    and the scaled backward, which adds into .grad. sync=False on a DDP model skips the gradients' all-reduce (the
    last micro-step's does it); on any other model no_sync is never entered. Returns the divided loss, detached."""
    no_sync = isinstance(model, DDP) and not sync
    with model.no_sync() if no_sync else nullcontext():
        with ctx:
            _, loss = model(x, y)
            loss = loss / accum_steps  # DDP averages over ranks: together the mean over the global batch
        scaler.scale(loss).backward()
    return loss.detach()


class GraphedMicroStep:
    """One training micro-step captured in a CUDA graph (cuda_graphs=True): micro_step's forward, loss / accum_steps
    and scaled backward, which adds into the parameters' .grad tensors, recorded once and replayed on the graph's own
    input buffers. An eager micro-step of a GPT-2-small-sized model spends most of its time in the host's kernel
    launches (benchmarks/RESULTS.md); a replay launches the whole step at once.

    Invariants: every .grad tensor exists and keeps its address for the graph's lifetime (the caller zeroes the
    gradients in place, never to None), so a replay accumulates into them as the eager backward does; each call
    copies its batch into the graph's x and y; the loss a call returns is overwritten by the next replay. Built at
    the first micro-step: three warm-up steps on a side stream (kernel compiles, the Triton kernels' config timing,
    torch.compile), gradients zeroed, then the capture."""

    def __init__(
        self,
        model: torch.nn.Module,
        dtype: str,
        scaler: torch.amp.GradScaler,
        accum_steps: int,
        x: torch.Tensor,
        y: torch.Tensor,
    ):
        self.model, self.scaler, self.accum_steps = model, scaler, accum_steps
        self.x, self.y = x.clone(), y.clone()
        # autocast's cache of cast weights must not live across the capture (PyTorch's CUDA-graph notes)
        self.ctx = autocast_context(dtype, "cuda", cache_enabled=False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = self._step()

    def _step(self) -> torch.Tensor:
        # on the graph's own input buffers; sync=True keeps no_sync out of the capture (cuda_graphs runs without DDP)
        return micro_step(self.model, self.x, self.y, self.ctx, self.scaler, self.accum_steps)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        return self.loss
