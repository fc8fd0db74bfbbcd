"""Evaluation: kvsim, SQuAD traces, prompts and metrics, the transformers reference of every
policy, model preparation and the paper benchmarks."""
