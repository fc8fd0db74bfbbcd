"""With MEPIC off, the plugin's scheduler inside the real vLLM engine is stock vLLM."""

from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.prepare import prepare_tiny_llama
from ascend_mepic.vllm_integration.class_names import SCHEDULER_CLS
from tests.engine_host import encode, run_engine


def test_scheduler_cls_with_mepic_off_matches_stock(tmp_path):
    model = str(prepare_tiny_llama(tmp_path / "tiny"))
    prompts = [encode([Segment.prompt(list(range(3, 3 + n)))]) for n in (5, 40, 77)]
    job = {
        "model": model,
        "mepic": False,
        "max_model_len": 512,
        "block_size": 32,
        "max_tokens": 12,
        "logprobs": 2,
        "batches": [prompts],
    }
    stock = run_engine(job)
    plugin = run_engine({**job, "scheduler_cls": SCHEDULER_CLS})
    assert [o["tokens"] for o in stock["batches"][0]] == [o["tokens"] for o in plugin["batches"][0]]
    assert all(len(o["tokens"]) == 12 for o in stock["batches"][0])
