"""Computation-path integration with vLLM's worker: NoPE RoPE, attention backend, model runner.

Everything here runs in the worker process and is installed by ``MepicCPUWorker`` (``--worker-cls``)
only when MEPIC is on; with MEPIC off nothing of vLLM changes.
"""
