"""The simulator's cost model: what one engine step computes and moves, and how long it takes.

``StepTracker`` reads what the scheduler hands the worker (vLLM's ``SchedulerOutput`` and, with
MEPIC on, the step plan on it) and turns one step into ``StepWork``: tokens through the linear
layers, query-key pairs in attention (and those whose K is rotated at read), KV read, logits,
host copies. The same tracker runs beside the real engine when ``bench profile`` calibrates a
profile, so the fitted rates and the simulation read a step the same way.

``step_seconds`` prices ``StepWork`` on a ``DeviceProfile``::

    t = step_overhead + seq_overhead * sequences
        + max(linear FLOPs / GEMM rate, weight bytes / memory rate)
        + attention FLOPs * (1 + rope_read_overhead for rotated pairs) / attention rate
        + KV bytes read / memory rate + host bytes / host rate

Approximations, each an upper bound on the work: every token a request computes attends to all
the tokens it reads from a cache (its shared or loaded chunk tokens), as an un-skipped mask
would; a CacheBlend request runs all its tokens (linear layers and attention queries) to the
check layer and the selected ones after it, as its policy says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ascend_mepic.eval.sim.profile import DeviceProfile

FEATURES = (
    "steps",
    "sequences",
    "linear_flops",
    "attention_flops",
    "rope_flops",
    "kv_bytes",
    "host_bytes",
)


@dataclass(frozen=True)
class ModelShape:
    """A decoder's dimensions, from its Hugging Face config (dense, gated MLP)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int

    @classmethod
    def from_hf_config(cls, name: str, cfg: Any, dtype_bytes: int) -> ModelShape:
        heads = cfg.num_attention_heads
        return cls(
            name=name,
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=heads,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size,
            dtype_bytes=dtype_bytes,
        )

    @property
    def layer_params(self) -> int:
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return q + kv + o + mlp

    @property
    def linear_flops_per_token(self) -> float:
        return 2.0 * self.layers * self.layer_params

    @property
    def logits_flops(self) -> float:
        return 2.0 * self.hidden * self.vocab

    @property
    def weight_bytes(self) -> int:
        """Weights a step streams: every layer and the LM head (embeddings are gathered)."""
        return (self.layers * self.layer_params + self.hidden * self.vocab) * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> float:
        """QK^T and PV for one query-key pair, all layers and heads."""
        return 4.0 * self.layers * self.heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass
class StepWork:
    sequences: int = 0
    tokens: float = 0.0  # token-layers / layers: tokens through every linear layer
    logits: int = 0  # sequences sampled this step
    pairs: float = 0.0  # attention query-key pairs
    rope_pairs: float = 0.0  # of which K is rotated at read (MEPIC's backend, any policy)
    kv_read_tokens: float = 0.0  # KV tokens attention reads
    host_tokens: int = 0  # KV tokens copied between host store and device

    def features(self, shape: ModelShape) -> dict[str, float]:
        """The quantities the profile's rates divide (``FEATURES``)."""
        return {
            "steps": 1.0,
            "sequences": float(self.sequences),
            "linear_flops": self.tokens * shape.linear_flops_per_token
            + self.logits * shape.logits_flops,
            "attention_flops": self.pairs * shape.attention_flops_per_pair,
            "rope_flops": self.rope_pairs * shape.attention_flops_per_pair,
            "kv_bytes": self.kv_read_tokens * shape.kv_bytes_per_token,
            "host_bytes": float(self.host_tokens * shape.kv_bytes_per_token),
        }


def step_seconds(work: StepWork, shape: ModelShape, profile: DeviceProfile) -> float:
    f = work.features(shape)
    linear = f["linear_flops"] / profile.gemm_flops_s
    if not profile.weights_in_overhead:
        linear = max(linear, shape.weight_bytes / profile.memory_bytes_s)
    attention = (
        f["attention_flops"] + profile.rope_read_overhead * f["rope_flops"]
    ) / profile.attention_flops_s
    return (
        profile.step_overhead_ms / 1e3
        + profile.seq_overhead_ms / 1e3 * f["sequences"]
        + linear
        + attention
        + f["kv_bytes"] / profile.memory_bytes_s
        + (f["host_bytes"] / profile.host_bytes_s if f["host_bytes"] else 0.0)
    )


@dataclass
class _Seq:
    length: int  # tokens the worker sees (a MEPIC request: its in-context tokens) + outputs
    cached: int = 0  # tokens it reads from a cache and never computes (shared or loaded chunks)
    rotated: bool = False  # K rotated at read (shared placement)
    blend: tuple[float, float] | None = None  # CacheBlend: (fraction of layers before the
    # check, fraction of tokens computed after it)
    emits: bool = True  # a request (not a chunk compile or tier load)


@dataclass
class StepTracker:
    """Follows the sequences of a run through the scheduler's outputs (one per step)."""

    num_layers: int
    seqs: dict[str, _Seq] = field(default_factory=dict)

    def read(self, output: Any) -> tuple[StepWork, list[str]]:
        """This step's work, and the ids of the requests that sample a token in it."""
        from ascend_mepic.vllm_integration import channel

        plan = None
        meta = getattr(output, "kv_connector_metadata", None)
        if isinstance(meta, channel.MepicStepMetadata):
            plan = meta.plan
        for req_id in output.finished_req_ids:
            self.seqs.pop(req_id, None)
        placements = plan.placements if plan is not None else {}
        computed: dict[str, int] = {}
        for new in output.scheduled_new_reqs:
            place = placements.get(new.req_id)
            seq = _Seq(length=len(new.prompt_token_ids or ()))
            # MEPIC's attention backend keeps every request's KV un-rotated and rotates K at
            # read, whatever the policy (full, EPIC and CacheBlend included); stock vLLM (no
            # plan) does not.
            seq.rotated = plan is not None
            if place is not None and not place.compile:
                seq.cached = max(0, place.layout.num_real_tokens - place.num_in_context)
                if place.blend is not None:
                    ratio, check = place.blend
                    chunk = sum(sp.num_tokens for sp in place.layout.chunk_spans)
                    before = min(1.0, (check + 1) / self.num_layers)
                    after = 1.0 - (1.0 - ratio) * chunk / max(1, seq.length)
                    seq.blend = (before, after)
            elif place is not None:  # a chunk compile: the chunk alone (or after its anchor)
                seq.emits = False
            self.seqs[new.req_id] = seq
            computed[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        work = StepWork()
        sampled: list[str] = []
        for req_id, n in output.num_scheduled_tokens.items():
            seq = self.seqs.get(req_id)
            if seq is None:  # a sequence this tracker never saw start: count it plainly
                seq = self.seqs[req_id] = _Seq(length=computed.get(req_id, 0) + n)
            done = computed.get(req_id, 0)
            work.sequences += 1
            share = 1.0  # of the step's tokens, layer-averaged, that run (CacheBlend: fewer)
            if seq.blend is not None:
                before, after = seq.blend
                share = before + (1.0 - before) * after
            work.tokens += n * share
            context = done + n + seq.cached
            pairs = n * (context - n / 2.0) * share
            work.pairs += pairs
            if seq.rotated:
                work.rope_pairs += pairs
            work.kv_read_tokens += context
            if seq.emits and done + n >= seq.length:
                sampled.append(req_id)
                seq.length += 1
        work.logits = len(sampled)
        if plan is not None:
            work.host_tokens = sum(h.num_tokens for h in plan.host_loads) + sum(
                s.num_tokens for s in plan.host_saves
            )
        return work, sampled
