"""The engine side of expert-parallel load balancing: the load window, when to rebalance, and
the layer-by-layer transfer task that hands staged layers to the step loop.

Two tasks share the job and no state:

- the step loop (`EngineCore.step`) calls `before_step` and `after_step`. Before a step it
  takes a staged layer if one is ready, without waiting (`receive_nowait` on a stream of size
  0: a result is there only while the transfer task is blocked offering it), and puts it in
  the step's `SchedulerOutput`; every rank adopts it before that step's forward pass. After
  the step it records the layer's `consumed` event, adds the step's expert load to the window
  and, every `step_interval` steps, starts a rebalance.
- the transfer task (`run`, a child of `open_engine`'s task group) computes the new placement
  (off the loop), then per layer: plans the moves, has every rank stage them
  (`Executor.eplb_stage_layer`), offers the `EplbLayerResult` to the step loop and waits for
  its `consumed` event before the next layer. So inference never pauses for a whole
  rebalance, and staging memory is one layer's moving experts.

With `use_async: false` the same transfer runs at the step boundary instead: the step loop
awaits every layer's staging and commit before the next step (the baseline that shows what the
asynchronous path buys).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from anyio.abc import TaskStatus

from engine.concurrency.device_event import DeviceEvent
from engine.concurrency.offload import run_sized
from engine.config import EplbConfig
from engine.core.stats import EplbStats, StatsObserver
from engine.eplb.maps import ExpertMaps, initial_phy2log
from engine.eplb.plan import LayerPlan, plan_layer
from engine.eplb.policy import rebalance_experts
from engine.eplb.window import LoadWindow, balancedness, logical_load
from engine.executor.base import Executor
from engine.model_info import ModelInfo

logger = logging.getLogger(__name__)


@dataclass
class EplbLayerResult:
    """One staged layer, from the transfer task to the step loop."""

    layer: int
    plan: LayerPlan  # the layer's new placement and the moves that realise it
    consumed: DeviceEvent = field(default_factory=DeviceEvent)  # recorded once a step has adopted it


class EplbDriver:
    def __init__(self, config: EplbConfig, executor: Executor, info: ModelInfo,
                 observer: StatsObserver | None = None) -> None:
        self.config = config
        self.executor = executor
        self.observer = observer
        self.num_logical = info.num_logical_experts
        self.num_physical = info.num_physical_experts
        self.num_ranks = info.num_expert_ranks
        phy2log = initial_phy2log(info.num_moe_layers, self.num_logical, self.num_physical)
        self.maps = ExpertMaps.from_phy2log(phy2log, self.num_logical)
        self.window = LoadWindow(config.window_size, info.num_moe_layers, self.num_physical)
        self.num_steps = 0
        self.rebalances = 0
        self.experts_moved = 0
        # Size 0: a request goes through only while the transfer task waits for one, so "is a
        # rebalance under way" needs no flag of its own.
        self._requests_send, self._requests = anyio.create_memory_object_stream[torch.Tensor](0)
        self._handoff_send, self._handoff = anyio.create_memory_object_stream[EplbLayerResult](0)
        self._offered: EplbLayerResult | None = None  # the result the transfer task waits on
        self._limiter = anyio.CapacityLimiter(1)

    # ---- the transfer task -------------------------------------------------------------------
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run asynchronous rebalances as the step loop asks for them, one at a time.

        Cancellation (the engine closing) abandons a rebalance between or inside layers: layers
        already committed stay, the rest keep their old placement (a consistent state either way)."""
        task_status.started()
        async with self._requests:
            async for load in self._requests:
                await self._rebalance(load, self._hand_over)

    @property
    def rebalancing(self) -> bool:
        """An asynchronous rebalance is under way (the transfer task is not waiting for work)."""
        return self.config.use_async and self._requests.statistics().tasks_waiting_receive == 0

    async def _hand_over(self, plan: LayerPlan) -> bool:
        result = EplbLayerResult(plan.layer, plan)
        self._offered = result
        try:
            await self._handoff_send.send(result)
        except anyio.BrokenResourceError:
            return False  # the step loop has stopped
        return await result.consumed.wait()

    async def _commit_now(self, plan: LayerPlan) -> bool:
        await self.executor.collective_rpc("eplb_commit_layer", (plan,))
        return True

    async def _rebalance(self, load: torch.Tensor, commit: Any) -> None:
        started = anyio.current_time()
        if self.config.log_balancedness:
            logger.info("EPLB rebalance %d starts; balancedness per layer %s", self.rebalances + 1,
                        _rounded(balancedness(load, self.num_ranks)))
        weight = logical_load(load, self.maps.phy2log, self.num_logical)
        # A small placement (a few dozen slots in all) is computed on the loop in under a
        # millisecond; a real model's (tens of layers x hundreds of slots) goes to a thread.
        new = await run_sized(rebalance_experts, weight, self.num_physical, 1, 1, self.num_ranks, self.maps.phy2log,
                              size=weight.shape[0] * self.num_physical, inline_below=64, limiter=self._limiter)
        moved = 0
        for layer in range(new.shape[0]):
            plan = plan_layer(layer, self.maps.phy2log[layer].tolist(), new[layer].tolist(), self.num_ranks)
            if not plan.moves:
                continue
            await self.executor.eplb_stage_layer(plan)
            if not await commit(plan):
                return  # stopped at shutdown
            phy2log = self.maps.phy2log.clone()
            phy2log[layer] = new[layer]
            self.maps = ExpertMaps.from_phy2log(phy2log, self.num_logical)
            moved += len(plan.moves)
        self.window.clear()  # its loads describe the old placement
        self.rebalances += 1
        self.experts_moved += moved
        seconds = anyio.current_time() - started
        logger.info("EPLB rebalance %d done: %d expert slots moved in %.3f s", self.rebalances, moved, seconds)
        if self.observer is not None:
            self.observer.on_eplb_rebalance(seconds, moved)

    # ---- called by the step loop -------------------------------------------------------------
    def before_step(self, sched_out: Any) -> EplbLayerResult | None:
        """Take a staged layer if the transfer task offers one (never waits); the step adopts it."""
        try:
            result = self._handoff.receive_nowait()
        except anyio.WouldBlock:
            return None
        sched_out.eplb_commit = result.plan
        return result

    async def after_step(self, adopted: EplbLayerResult | None, expert_load: Any) -> None:
        """Release an adopted layer, count the step, and start a rebalance every `step_interval`
        steps. Returns at once, except with `use_async: false`: then the whole rebalance runs here.

        Cancellation (synchronous mode) abandons the rebalance at a layer boundary or mid-call."""
        if adopted is not None:
            adopted.consumed.record()
        if expert_load is not None:  # [MoE layers][physical] token counts, nested lists or a tensor
            self.window.add(torch.as_tensor(expert_load, dtype=torch.long))
        self.num_steps += 1
        if self.num_steps % self.config.step_interval:
            return
        if not self.config.use_async:
            await self._rebalance(self.window.total.clone(), self._commit_now)
            return
        try:
            self._requests_send.send_nowait(self.window.total.clone())
        except anyio.WouldBlock:
            logger.warning("EPLB: step %d is due a rebalance but the last one is still moving experts; skipped",
                           self.num_steps)

    def stop(self) -> None:
        """The step loop is ending: a transfer task waiting for a step to adopt its layer stops."""
        self._requests_send.close()
        self._handoff.close()
        if self._offered is not None:
            self._offered.consumed.stop()

    def stats(self) -> EplbStats:
        return EplbStats(self.rebalances, self.experts_moved,
                         tuple(balancedness(self.window.total, self.num_ranks)), self.rebalancing)

    def placement(self) -> list[list[int]]:
        """The engine's view of each MoE layer's slot -> expert map (what the workers route with)."""
        return [row.tolist() for row in self.maps.phy2log]


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]
