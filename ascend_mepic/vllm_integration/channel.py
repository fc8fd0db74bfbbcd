"""The scheduler-to-worker channel: one ``StepPlan`` per step on ``SchedulerOutput``.

Why this field: ``SchedulerOutput.kv_connector_metadata`` is vLLM's own slot for data a
scheduler-side component sends to the workers alongside a step (KV connectors such as
LMCache's use it); it is pickled to every worker with the step. MEPIC refuses KV connectors, so
the slot is free, and vLLM 0.30.0 reads it only when a KV-transfer group exists. The worker
refuses a step without a plan when MEPIC is on, rather than guessing.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ascend_mepic.core.plan import StepPlan, StepPlanError


class MepicStepMetadata(KVConnectorMetadata):
    """Carrier of a ``StepPlan`` in the KV-connector metadata slot."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def attach(scheduler_output, plan: StepPlan) -> None:
    if scheduler_output.kv_connector_metadata is not None:
        raise StepPlanError(
            "SchedulerOutput.kv_connector_metadata is taken (a KV connector is configured); "
            "MEPIC does not support KV connectors"
        )
    scheduler_output.kv_connector_metadata = MepicStepMetadata(plan)


def receive(scheduler_output) -> StepPlan:
    meta = scheduler_output.kv_connector_metadata
    if not isinstance(meta, MepicStepMetadata):
        raise StepPlanError(
            "MEPIC's worker got a step without a MEPIC step plan (found "
            f"{type(meta).__name__}); run the engine with --scheduler-cls "
            "ascend_mepic.core.scheduler.MepicScheduler and the same --additional-config"
        )
    return meta.plan
