"""The serving simulator: vLLM's engine core and MEPIC's scheduling path on a modelled device
(``ascend-mepic bench simulate``; docs/simulator.md)."""
