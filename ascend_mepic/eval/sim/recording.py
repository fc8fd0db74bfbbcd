"""Schedulers that record each step, for calibrating a device profile and for measuring peak KV.

``ascend-mepic bench profile`` and ``bench simulate validate`` run the real engine with one of
these as ``--scheduler-cls`` (vLLM's hook), and the simulator runs with them too:

- every ``schedule()`` records the blocks in use right after it: the step's high-water mark. A
  step allocates in ``schedule()`` and frees its finished requests only in ``update_from_output``,
  so a count read between steps misses the moment a new prompt's blocks and a finishing
  request's blocks are both held, and real and simulated runs whose steps end a few
  milliseconds apart would then disagree by a whole request;
- the recording schedulers also read each step's work with the same ``StepTracker`` the
  simulated worker uses, and the benchmark loop pairs every record with the wall time of the
  engine step that ran it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from ascend_mepic.core.scheduler import MepicScheduler
from ascend_mepic.eval.sim.cost import StepTracker, StepWork

RECORDING_SCHEDULER_CLS = "ascend_mepic.eval.sim.recording.RecordingMepicScheduler"
RECORDING_STOCK_SCHEDULER_CLS = "ascend_mepic.eval.sim.recording.RecordingScheduler"
PEAK_SCHEDULER_CLS = "ascend_mepic.eval.sim.recording.PeakMepicScheduler"
PEAK_STOCK_SCHEDULER_CLS = "ascend_mepic.eval.sim.recording.PeakScheduler"


def used_blocks(manager: Any) -> int:
    """Blocks held by requests: MEPIC's own count, or the pool less its free and evictable ones."""
    if hasattr(manager, "num_used_blocks"):
        return manager.num_used_blocks()
    return manager.block_pool.num_gpu_blocks - 1 - manager.block_pool.get_num_free_blocks()


class PeakRecorder:
    """Mixin: the blocks in use right after each ``schedule()``, in order."""

    scheduled_blocks: list[int]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if not hasattr(self, "scheduled_blocks"):
            self.scheduled_blocks = []
        self.scheduled_blocks.append(used_blocks(self.kv_cache_manager))  # type: ignore[attr-defined]
        return output


class StepRecorder(PeakRecorder):
    """Mixin: also the work of every step this scheduler hands the worker, in order."""

    recorded_work: list[StepWork]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        if not hasattr(self, "_step_tracker"):
            layers = self.vllm_config.model_config.get_num_layers(  # type: ignore[attr-defined]
                self.vllm_config.parallel_config  # type: ignore[attr-defined]
            )
            self._step_tracker = StepTracker(layers)
            self.recorded_work = []
        self.recorded_work.append(self._step_tracker.read(output)[0])
        return output


class PeakMepicScheduler(PeakRecorder, MepicScheduler):
    pass


class PeakScheduler(PeakRecorder, Scheduler):
    pass


class RecordingMepicScheduler(StepRecorder, MepicScheduler):
    pass


class RecordingScheduler(StepRecorder, Scheduler):
    pass
