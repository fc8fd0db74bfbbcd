"""With MEPIC off, the plugin's scheduler inside the real vLLM engine is stock vLLM."""

import os
import subprocess
import sys
import textwrap

from ascend_mepic.eval.prepare import prepare_tiny_llama

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        model, sched = sys.argv[1], sys.argv[2]
        kwargs = {"scheduler_cls": sched} if sched != "stock" else {}
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
                  block_size=32, seed=0, **kwargs)
        params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
        prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 77)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        print("RESULT" + json.dumps([o.outputs[0].token_ids for o in outs]))
    """
)


def run_engine(model, sched):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), sched],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return line[len("RESULT") :]


def test_scheduler_cls_with_mepic_off_matches_stock(tmp_path):
    model = prepare_tiny_llama(tmp_path / "tiny")
    stock = run_engine(model, "stock")
    plugin = run_engine(model, "ascend_mepic.core.scheduler.MepicScheduler")
    assert stock == plugin
