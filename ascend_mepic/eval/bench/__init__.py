"""Online-style benchmarks in the real vLLM engine (``ascend-mepic bench ...``).

``stats`` holds the pure parts (arrivals, fidelity math, summaries, workload statistics, report
rendering); ``runner`` drives one engine in its own process; ``main`` is the command line.
"""
