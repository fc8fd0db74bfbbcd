"""Schedulers that record each step's work, for calibrating a device profile on a real engine.

``ascend-mepic bench profile`` runs the real engine with one of these as ``--scheduler-cls``
(vLLM's hook): each ``schedule()`` is read by the same ``StepTracker`` the simulated worker uses,
and the benchmark loop pairs every record with the wall time of the engine step that ran it.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from ascend_mepic.core.scheduler import MepicScheduler
from ascend_mepic.eval.sim.cost import StepTracker, StepWork

RECORDING_SCHEDULER_CLS = "ascend_mepic.eval.sim.recording.RecordingMepicScheduler"
RECORDING_STOCK_SCHEDULER_CLS = "ascend_mepic.eval.sim.recording.RecordingScheduler"


class StepRecorder:
    """Mixin: the work of every step this scheduler hands the worker, in order."""

    recorded_work: list[StepWork]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if not hasattr(self, "_step_tracker"):
            layers = self.vllm_config.model_config.get_num_layers(  # type: ignore[attr-defined]
                self.vllm_config.parallel_config  # type: ignore[attr-defined]
            )
            self._step_tracker = StepTracker(layers)
            self.recorded_work = []
        self.recorded_work.append(self._step_tracker.read(output)[0])
        return output


class RecordingMepicScheduler(StepRecorder, MepicScheduler):
    pass


class RecordingScheduler(StepRecorder, Scheduler):
    pass
