"""Run vLLM on the NPU (vllm-ascend) on a JSON job in a fresh process and print JSON results.

UNTESTED ON HARDWARE. Job: {"model", "mepic": bool, "policy", "dtype", "requests":
[[[kind, [ids...]], ...], ...], "max_tokens"}. Stock runs get the concatenated token ids;
MEPIC runs get the segments (``generate_segments``). Greedy, 5 logprobs per step.
"""

import json
import sys


def main() -> None:
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    from ascend_mepic.offline import Segment, generate_segments, mepic_llm_kwargs

    # Eager in both: MEPIC's NPU path runs eager (mepic_llm_kwargs), so stock does too.
    kwargs = mepic_llm_kwargs(policy=job["policy"]) if job["mepic"] else {"enforce_eager": True}
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=1024,
        block_size=128,
        seed=0,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], logprobs=5)
    reqs = [[Segment.chunk(ids) if k == "chunk" else Segment.prompt(ids) for k, ids in r]
            for r in job["requests"]]  # fmt: skip
    if job["mepic"]:
        outs = generate_segments(llm, reqs, params)
    else:
        prompts = [{"prompt_token_ids": [t for s in r for t in s.token_ids]} for r in reqs]
        outs = llm.generate(prompts, params, use_tqdm=False)
    from vllm.platforms import current_platform

    results = [
        {
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [{str(t): v.logprob for t, v in d.items()} for d in o.outputs[0].logprobs],
        }
        for o in outs
    ]
    print("RESULT" + json.dumps({"platform": current_platform.device_type, "outputs": results}))


if __name__ == "__main__":
    main()
