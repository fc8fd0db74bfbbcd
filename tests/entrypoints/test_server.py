"""MEPIC behind vLLM's OpenAI server (`ascend-mepic serve`), end to end over HTTP.

One real server (tiny random Llama, float32, CPU) runs for the whole module as a subprocess; the
offline comparison runs the engine once more in its own process (tests/engine_runner.py).
"""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from ascend_mepic.core.markers import MarkerError, segments_from_text
from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.prepare import prepare_tiny_llama

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 60

BEGIN, END = "<<<MEPIC_CHUNK>>>", "<<<END_MEPIC_CHUNK>>>"
PER_SALT_PINNED_BLOCKS = 10
DOCS = [
    "The quick fox sees the old river near a small village. A brave teacher helps the "
    "student across the bridge. Every morning the farmer carries a golden letter to the market.",
    "Some clever doctor writes a strange story about the island. The tired child reads it "
    "slowly beside the kitchen window, and the quiet cat watches the summer road.",
    "Our careful engineer builds a silver machine under the castle. The happy friend moves "
    "the green garden bench into the library, then answers every question again.",
    "A lazy dog follows the red bird through the forest. Each winter evening the gentle "
    "farmer remembers the ocean, the mountain and the bright city far away.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _endpoint_metadata_dir(tmp: Path) -> str | None:
    """A dist-info that declares the endpoint entry point, when the installed one predates it.

    Only for running these tests in an environment installed before the entry point was added
    to setup.py; a fresh `pip install -e .` makes this a no-op.
    """
    from ascend_mepic.entrypoints.server import endpoint_plugin_installed

    if endpoint_plugin_installed():
        return None
    info = tmp / "ascend_mepic_endpoint_test_shim-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: ascend-mepic-endpoint-test-shim\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(
        "[vllm.endpoint_plugins]\n"
        "ascend_mepic = ascend_mepic.entrypoints.server:MepicEndpointPlugin\n"
    )
    return str(tmp)


@pytest.fixture(scope="module")
def model() -> str:
    return str(prepare_tiny_llama())


def launch_server(model: str, tmp: Path, extra_args: list[str] = ()) -> tuple[str, Callable]:
    """Start ``ascend-mepic serve`` on the tiny model; returns (url, stop) once it is healthy."""
    port = _free_port()
    paths = [p for p in (_endpoint_metadata_dir(tmp / "meta"), str(REPO)) if p]
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # with `uni` below; AsyncLLM's core stays a process
        PYTHONPATH=os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    env.pop("VLLM_PLUGINS", None)
    # LMCache sets this in-process when a tier test ran first; a server inheriting it would use
    # prometheus' multiprocess registry (see the warning in ascend_mepic serve).
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    cmd = [
        sys.executable,
        "-m",
        "ascend_mepic.entrypoints.cli",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "1024",
        # A small step budget (compiles take at most 511 tokens) makes the engine-side rejection
        # testable.
        "--max-num-batched-tokens",
        "512",
        # Two processes per server, not three: the worker inside the engine core. Each process's
        # imports cost about 18 s of CPU on 2 cores. vLLM's CPU platform turns `uni` back into
        # `mp` unless VLLM_ENABLE_V1_MULTIPROCESSING=0 (set above), which the API server's
        # AsyncLLM ignores. The README's server (tests/test_docs.py) keeps vLLM's defaults.
        "--distributed-executor-backend",
        "uni",
        *extra_args,
    ]
    tmp.mkdir(parents=True, exist_ok=True)
    log_path = tmp / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
    )

    def stop() -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stop()
            pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url, stop
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop()
    pytest.fail(f"server not healthy in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory, request) -> str:
    # A request's chat_template (trusted here) renders vLLM's documents, which the tiny
    # model's template does not.
    # A small per-salt pin quota (blocks of 32 tokens) makes the quota testable. The module's
    # requests open in many ways, and the chunk API's per-prefix identities are checked here:
    # anchored always (`auto`'s switch: tests/core/test_anchors.py, test_serving_offline.py).
    config = {
        "mepic": {"max_pinned_blocks_per_salt": PER_SALT_PINNED_BLOCKS, "chunk_anchor": "prefix"}
    }
    args = ["--trust-request-chat-template", "--additional-config", json.dumps(config)]
    url, stop = launch_server(model, tmp_path_factory.mktemp("mepic-server"), args)
    request.addfinalizer(stop)
    return url


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


def marked(doc: str, question: str = "What happens?") -> str:
    return f"Read this: {BEGIN}{doc}{END} {question}"


def complete(client: httpx.Client, prompt, **kw) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, **kw}
    return client.post("/v1/completions", json=body)


def fresh_stats(client: httpx.Client) -> dict:
    """The scheduler publishes stats at most every 0.25 s while it schedules: wait, then make
    it schedule once more so the snapshot covers everything before this call."""
    time.sleep(0.35)
    assert complete(client, "a", max_tokens=1).status_code == 200
    r = client.get("/v1/mepic/stats")
    assert r.status_code == 200, r.text
    return r.json()


def chunk_blocks(stats: dict, request_id: str) -> list[list[int]]:
    """Block ids of each chunk of the request whose API id was ``request_id``."""
    for rid, blocks in stats["recent_chunk_blocks"]:
        if rid.startswith(f"cmpl-{request_id}-"):
            return blocks
    raise AssertionError(f"{request_id} not in recent_chunk_blocks")


def test_concurrent_chat_with_markers(server, client):
    before = fresh_stats(client)["metrics"]

    async def run() -> list[httpx.Response]:
        limit = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=server, timeout=REQUEST_TIMEOUT_S) as ac:

            async def one(i: int) -> httpx.Response:
                messages = [
                    {"role": "system", "content": "Answer from the documents."},
                    {"role": "user", "content": marked(DOCS[i % len(DOCS)], f"Question {i}?")},
                ]
                body = {"messages": messages, "max_tokens": 4, "temperature": 0.0}
                async with limit:
                    return await ac.post("/v1/chat/completions", json=body)

            return await asyncio.gather(*(one(i) for i in range(50)))

    responses = asyncio.run(asyncio.wait_for(run(), timeout=180))
    for r in responses:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] in ("length", "stop")
        assert body["usage"]["completion_tokens"] >= 1
    after = fresh_stats(client)["metrics"]
    delta = {k: after[k] - before[k] for k in ("chunk_hits", "chunk_misses", "requests_admitted")}
    # Each distinct document is computed at most once; every other use of it is a hit.
    assert delta["requests_admitted"] == 50
    assert delta["chunk_hits"] + delta["chunk_misses"] == 50
    assert delta["chunk_misses"] <= len(DOCS)


def test_chat_streaming_with_markers(client):
    body = {
        "messages": [{"role": "user", "content": marked(DOCS[0])}],
        "max_tokens": 3,
        "temperature": 0.0,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_chat_streaming_with_logprobs_through_the_openai_client(server, model):
    """The official ``openai`` client streams a marked chat request with logprobs: vLLM's own
    chunk models, each token's logprob and its ``top_logprobs`` likeliest, as the same request
    unstreamed returns them."""
    import openai

    api = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S)
    ask = {
        "model": model,
        "messages": [{"role": "user", "content": marked(DOCS[2])}],
        "max_tokens": 4,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    text, content = "", []
    for chunk in api.chat.completions.create(**ask, stream=True):
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                content += choice.logprobs.content or []
    whole = api.chat.completions.create(**ask).choices[0]
    assert text == whole.message.content and len(content) == 4
    assert [c.token for c in content] == [c.token for c in whole.logprobs.content]
    for streamed, unstreamed in zip(content, whole.logprobs.content, strict=True):
        assert streamed.logprob == pytest.approx(unstreamed.logprob, abs=1e-4)
        assert len(streamed.top_logprobs) == 2
        best = [t.logprob for t in streamed.top_logprobs]
        assert best == sorted(best, reverse=True) and streamed.logprob <= best[0] + 1e-4
        assert streamed.bytes == list(streamed.token.encode("utf-8", "replace"))


def test_metrics_show_chunk_sharing(client):
    for question in ("First?", "Second?"):
        assert complete(client, marked(DOCS[1], question)).status_code == 200
    fresh_stats(client)
    text = client.get("/metrics").text

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
        assert m, f"{name} missing from /metrics"
        return float(m.group(1))

    assert value("ascend_mepic_stats_available") == 1
    assert value("ascend_mepic_chunk_hits_total") > 0
    assert value("ascend_mepic_tokens_reused_total") > 0
    shared = value('ascend_mepic_kv_blocks{category="chunk_shared_referenced"}') + value(
        'ascend_mepic_kv_blocks{category="chunk_shared_idle"}'
    )
    assert shared > 0


@pytest.mark.parametrize(
    "prompt, needle",
    [
        (f"Q {BEGIN}doc without end", "offset 2 is never closed"),
        (f"Q doc{END} tail", "no matching begin"),
        (f"Q {BEGIN}a {BEGIN}b{END}{END} tail", "nested"),
        (f"Q {BEGIN}{END} tail", "empty chunk"),
        (f"Q {BEGIN}doc{END}", "must end with prompt text"),
        ("Q <<<MEPIC_CHUNK_REF:0123456789abcdef>>> tail", "unknown chunk id"),
        (f"Q {BEGIN}x <<<MEPIC_CHUNK_REF:abc>>>{END} tail", "inside chunk markers"),
    ],
)
def test_malformed_requests_are_400_and_server_keeps_serving(client, prompt, needle):
    r = complete(client, prompt)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=chat)
    if needle.startswith("must end"):
        # The chat template always writes prompt text after the last message.
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert needle in message
        assert message.startswith("messages[0]") or "unknown chunk id" in needle
    assert complete(client, marked(DOCS[2])).status_code == 200


def test_requests_that_cannot_fit_are_400(client):
    """The server answers 400 with the words ``LLM.generate`` raises (one rule:
    ``core.request_limits``), before the engine sees the request."""
    ids = [5 + i % 400 for i in range(1030)]
    r = complete(
        client,
        [1, *ids, 7],
        vllm_xargs={"mepic_segments": ["prompt", 1, "chunk", 1030, "prompt", 1]},
    )
    assert r.status_code == 400
    assert "maximum model length of 1024" in r.json()["error"]["message"]
    # Fits max_model_len but not one step's batch (512 tokens): no step could compile it.
    xargs = {"mepic_segments": ["prompt", 1, "chunk", 600, "prompt", 1]}
    for stream in (False, True):
        r = complete(client, [1, *ids[:600], 7], vllm_xargs=xargs, stream=stream)
        assert r.status_code == 400 and "more than one step can compile" in r.text
    # More chunks than the engine's block table is sized for (max_chunks_per_request, 64).
    lengths: list = ["prompt", 1]
    for _ in range(65):
        lengths += ["chunk", 2, "prompt", 1]
    r = complete(client, [1, *ids[: 65 * 3]], vllm_xargs={"mepic_segments": lengths})
    assert r.status_code == 400
    assert "65 chunks; this engine serves at most 64" in r.json()["error"]["message"]
    bad = complete(client, [1, 2, 3], vllm_xargs={"mepic_segments": ["prompt", 2, "chunk", 1]})
    assert bad.status_code == 400
    assert complete(client, marked(DOCS[2])).status_code == 200


def test_chunk_api_round_trip(client):
    doc = DOCS[3] + " " + DOCS[0]
    # Registered for the requests' prefix, which anchored compiles compile the chunk after.
    body = {"text": doc, "prefix": "Read this: "}
    r = client.post("/v1/chunks", json=body)
    assert r.status_code == 200, r.text
    chunk = r.json()
    assert chunk["num_tokens"] > 32 and chunk["num_shared_blocks"] >= 1
    assert chunk["num_prefix_tokens"] > 0
    assert client.post("/v1/chunks", json=body).json()["id"] == chunk["id"]
    other = client.post("/v1/chunks", json={"text": doc}).json()  # another prefix: another one
    assert other["id"] != chunk["id"] and other["num_prefix_tokens"] == 0
    assert client.delete(f"/v1/chunks/{other['id']}").json()["removed"] is True
    pinned = fresh_stats(client)["metrics"]["chunk_hits"]
    listed = client.get("/v1/chunks").json()["data"]
    assert chunk["id"] in [c["id"] for c in listed]
    assert fresh_stats(client)["metrics"]["pinned_chunks"] >= 1

    ref = f"<<<MEPIC_CHUNK_REF:{chunk['id']}>>>"
    r = complete(client, f"Read this: {ref} What now?", request_id="ref-1")
    assert r.status_code == 200, r.text
    assert fresh_stats(client)["metrics"]["chunk_hits"] == pinned + 1  # the pinned chunk
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": f"{ref} Summarize."}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text
    # A marked request with the same prefix reads the same pinned chunk (its blocks may have
    # moved since ref-1: an idle chunk used again may be placed anew next to the chunks in use).
    hits = fresh_stats(client)["metrics"]["chunk_hits"]
    assert complete(client, marked(doc), request_id="ref-2").status_code == 200
    stats = fresh_stats(client)
    assert stats["metrics"]["chunk_hits"] == hits + 1

    # Registered twice (two holders): the first delete keeps it, the last one removes it.
    first = client.delete(f"/v1/chunks/{chunk['id']}").json()
    assert first["removed"] is False and first["holders"] == 1
    assert complete(client, f"Context: {ref} Still here?").status_code == 200
    assert client.delete(f"/v1/chunks/{chunk['id']}").json()["removed"] is True
    assert chunk["id"] not in [c["id"] for c in client.get("/v1/chunks").json()["data"]]
    assert client.delete(f"/v1/chunks/{chunk['id']}").status_code == 404
    assert complete(client, f"Context: {ref} What now?").status_code == 400
    assert client.post("/v1/chunks", json={"text": "x", "token_ids": [1]}).status_code == 400


def test_tenants_with_different_salts_share_no_chunk_blocks(client):
    doc = DOCS[2] + " " + DOCS[1]
    for rid, salt in (("salt-a-1", "tenant-a"), ("salt-a-2", "tenant-a"), ("salt-b-1", "tenant-b")):
        r = complete(client, marked(doc), request_id=rid, cache_salt=salt)
        assert r.status_code == 200, r.text
    stats = fresh_stats(client)
    a1, a2, b1 = (chunk_blocks(stats, rid)[0] for rid in ("salt-a-1", "salt-a-2", "salt-b-1"))
    assert len(a1) >= 3
    assert a1[1:] == a2[1:]  # the same tenant shares
    assert not set(a1) & set(b1)  # another tenant shares nothing

    # A chunk registered under one salt is unknown to requests with another.
    cid = client.post("/v1/chunks", json={"text": doc, "cache_salt": "tenant-a"}).json()["id"]
    ref = f"<<<MEPIC_CHUNK_REF:{cid}>>>"
    assert complete(client, f"{ref} Q?", cache_salt="tenant-b").status_code == 400
    assert complete(client, f"{ref} Q?", cache_salt="tenant-a").status_code == 200
    assert client.delete(f"/v1/chunks/{cid}").status_code == 200


def test_completions_match_offline_engine(client, model):
    from transformers import AutoTokenizer

    from tests.engine_host import run_engine

    tok = AutoTokenizer.from_pretrained(model)
    text = f"Hello {BEGIN}{DOCS[0]} {DOCS[3]}{END} and {BEGIN}{DOCS[1]}{END} so, what?"
    segments = segments_from_text(tok, text)
    want_prompt = [t for s in segments for t in s.token_ids]
    r = complete(client, text, max_tokens=8, return_token_ids=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == want_prompt
    flat = [x for s in segments for x in (s.kind.value, len(s.token_ids))]
    token_level = complete(
        client,
        want_prompt,
        max_tokens=8,
        vllm_xargs={"mepic_segments": flat},
        return_token_ids=True,
    )
    assert token_level.status_code == 200, token_level.text

    job = {
        "model": model,
        "mepic": True,
        "block_size": 32,
        "max_model_len": 1024,
        "max_tokens": 8,
        "logprobs": 1,
        "batches": [[{"segments": [[s.kind.value, list(s.token_ids)] for s in segments]}]],
    }
    offline = run_engine(job)["batches"][0][0]["tokens"]
    assert choice["token_ids"] == offline
    assert token_level.json()["choices"][0]["token_ids"] == offline


# The tiny model's template, plus vLLM's documents in a system turn before the messages.
DOCS_TEMPLATE = (
    "{% if documents %}{{ '<|im_start|>system\\n' }}{% for d in documents %}"
    "{{ d['text'] + '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chunk_part(text: str) -> dict:
    return {"type": "text", "text": text, "mepic": {"chunk": True}}


def ref_part(chunk_id: str) -> dict:
    return {"type": "text", "text": "", "mepic": {"chunk_id": chunk_id}}


def test_chunk_parts_references_and_documents_equal_the_marker_form(server, client, model):
    """Through the official ``openai`` client: a chunk part, a reference part and vLLM's
    ``documents`` give the marker form's prompt tokens and answer for the same text, and the
    marker form then finds every chunk cached (the same chunks)."""
    import openai

    api = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_TIMEOUT_S)
    question = "What happens?"

    def chat(content, system: str | None = None, **extra) -> dict:
        messages = [{"role": "user", "content": content}]
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        r = api.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=6,
            temperature=0.0,
            extra_body={"return_token_ids": True, "chat_template": DOCS_TEMPLATE, **extra},
        )
        return r.model_dump()

    cid = client.post("/v1/chunks", json={"text": DOCS[3]}).json()["id"]
    docs = [{"title": "a", "text": DOCS[1]}, {"title": "b", "text": DOCS[2]}]
    structured = [
        chat([{"type": "text", "text": "Read:"}, chunk_part(DOCS[0]), question]),
        chat([ref_part(cid), {"type": "text", "text": question}]),
        chat(question, documents=docs, mepic={"chunk_documents": True}),
    ]
    before = fresh_stats(client)["metrics"]
    marked_form = [
        chat(f"Read:\n{BEGIN}{DOCS[0]}{END}\n{question}"),
        chat(f"{BEGIN}{DOCS[3]}{END}\n{question}"),
        chat(question, system="".join(f"{BEGIN}{d['text']}{END}\n" for d in docs)),
    ]
    after = fresh_stats(client)["metrics"]
    for got, want in zip(structured, marked_form, strict=True):
        assert got["prompt_token_ids"] == want["prompt_token_ids"]
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert after["chunk_misses"] == before["chunk_misses"]
    assert after["chunk_hits"] - before["chunk_hits"] == 4
    assert client.delete(f"/v1/chunks/{cid}").status_code == 200


def test_structured_form_serves_marker_strings_verbatim(client, model):
    """In the structured form a marker string is text like any other (the marker form of the
    same text is a 400), and a multi-part message is vLLM's prompt to the token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    typed = f"Q {BEGIN} and {END}<<<MEPIC_CHUNK_REF:x>>> "
    r = complete(client, [typed, chunk_part(DOCS[0]), " tail"], return_token_ids=True)
    assert r.status_code == 200, r.text
    encode = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    want = [tok.bos_token_id, *encode(typed), *encode(DOCS[0]), *encode(" tail")]
    assert r.json()["choices"][0]["prompt_token_ids"] == want
    assert complete(client, typed + DOCS[0] + " tail").status_code == 400

    parts = [{"type": "text", "text": t} for t in (typed, "second part", "third")]
    messages = [{"role": "user", "content": parts}]
    stock = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"messages": messages, "max_tokens": 2, "return_token_ids": True, "mepic": {}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == stock
    assert stock == tok.encode(
        tok.apply_chat_template(
            [{"role": "user", "content": "\n".join(p["text"] for p in parts)}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )


@pytest.mark.parametrize(
    "body, needle",
    [
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "x", "mepic": {"chunk": True, "bogus": 1}},
                            "q",
                        ],
                    }
                ]
            },
            "messages[0].content[0].mepic",
        ),
        (
            {"messages": [{"role": "user", "content": [chunk_part(""), "q"]}]},
            "messages[0].content[0]: a chunk part needs non-empty text",
        ),
        (
            {"messages": [{"role": "user", "content": [ref_part("0" * 32), "q"]}]},
            "unknown chunk id",
        ),
        (
            {
                "messages": [{"role": "user", "content": "q"}],
                "mepic": {"chunk_documents": True},
                "documents": [{"text": "d"}],
            },
            "does not render documents",
        ),
        ({"prompt": [{"text": "x", "mepic": {"chunk": 1}}, "q"]}, "prompt[0].mepic"),
        ({"prompt": [{"text": "x", "mepic": {"chunk": True}}]}, "must end with prompt text"),
    ],
)
def test_malformed_structured_requests_are_400(client, body, needle):
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = client.post(route, json={**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_pins_past_a_salts_quota_are_429_and_other_tenants_are_served(client):
    """One tenant registering chunk after chunk gets a 429 naming its limit, before anything
    is evicted; another tenant's requests and registrations keep being served."""
    ids, refused = [], None
    for i in range(12):
        doc = f"Note {i}: " + DOCS[i % 4] + " " + DOCS[(i + 1) % 4]
        r = client.post("/v1/chunks", json={"text": doc, "cache_salt": "greedy"})
        if r.status_code != 200:
            refused = r
            break
        ids.append(r.json()["id"])
    assert refused is not None and refused.status_code == 429, refused and refused.text
    message = refused.json()["error"]["message"]
    assert "max_pinned_blocks_per_salt" in message and f"of the {PER_SALT_PINNED_BLOCKS}" in message
    assert len(ids) >= 2
    metrics = fresh_stats(client)["metrics"]
    assert metrics["pinned_blocks_per_salt_limit"] == PER_SALT_PINNED_BLOCKS
    assert 0 < metrics["pinned_blocks_top_salt"] <= PER_SALT_PINNED_BLOCKS
    assert metrics["pinned_blocks"] <= metrics["pinned_blocks_limit"]
    r = complete(client, marked(DOCS[0], "Still served?"), cache_salt="other")
    assert r.status_code == 200, r.text
    other = client.post("/v1/chunks", json={"text": DOCS[1], "cache_salt": "other"})
    assert other.status_code == 200, other.text
    for chunk_id in [*ids, other.json()["id"]]:
        assert client.delete(f"/v1/chunks/{chunk_id}").status_code == 200


# ---------------------------------------------------------------- without a server


def test_plugin_changes_nothing_without_mepic_config():
    from ascend_mepic.entrypoints.server import MepicEndpointPlugin

    for additional in ({}, {"other": 1}, {"mepic": {"enabled": False}}):
        app = FastAPI()
        app.state.args = Namespace(additional_config=additional)
        before = list(app.routes)
        MepicEndpointPlugin().attach_router(app)
        assert list(app.routes) == before
        assert not hasattr(app.state, "mepic_config")


def test_serve_defaults_merge_with_user_options(monkeypatch):
    import shutil

    from ascend_mepic.config import STATS_FILE_ENV, MepicConfig
    from ascend_mepic.entrypoints.server import apply_mepic_defaults

    def args(**kw) -> Namespace:
        base = dict(
            scheduler_cls=None,
            worker_cls="auto",
            enable_prefix_caching=None,
            block_size=None,
            additional_config={},
        )
        return Namespace(**{**base, **kw})

    a, environ = args(), {}
    temp = apply_mepic_defaults(a, is_cpu=True, environ=environ)
    assert a.scheduler_cls == "ascend_mepic.core.scheduler.MepicScheduler"
    assert a.worker_cls == "ascend_mepic.worker.cpu_worker.MepicCPUWorker"
    assert a.enable_prefix_caching is True and a.block_size == 32
    assert a.async_scheduling is False
    # The server's own stats file travels in the environment: the engine configuration (vLLM's
    # compile cache key) is the same at every start.
    assert a.additional_config == {"mepic": {}}
    assert environ[STATS_FILE_ENV].startswith(temp)
    monkeypatch.setenv(STATS_FILE_ENV, environ[STATS_FILE_ENV])
    assert MepicConfig.from_additional_config(a.additional_config).stats_file.startswith(temp)
    shutil.rmtree(temp)

    a = args(block_size=16, additional_config={"x": 1, "mepic": {"stats_file": "/s.json"}})
    assert apply_mepic_defaults(a, is_cpu=True, environ=environ) is None
    assert a.block_size == 16
    assert a.additional_config == {"x": 1, "mepic": {"stats_file": "/s.json"}}
    with pytest.raises(ValueError, match="prefix caching"):
        apply_mepic_defaults(args(enable_prefix_caching=False), is_cpu=True, environ=environ)
    with pytest.raises(ValueError, match="async scheduling"):
        apply_mepic_defaults(args(async_scheduling=True), is_cpu=True, environ=environ)

    with pytest.raises(ValueError, match="unknown MEPIC option"):
        apply_mepic_defaults(
            args(additional_config={"mepic": {"bogus": 1, "stats_file": "/s"}}), is_cpu=True
        )


def test_marked_text_segments_with_references(model):
    from transformers import AutoTokenizer

    from ascend_mepic.core.markers import Markers
    from ascend_mepic.entrypoints.server import MepicRequestError, marked_text_segments

    tok = AutoTokenizer.from_pretrained(model)
    doc = tok.encode("the river", add_special_tokens=False)

    def resolve(chunk_id: str) -> list[int]:
        if chunk_id != "abc":
            raise MepicRequestError(f"unknown chunk id {chunk_id!r}")
        return doc

    text = f"Q <<<MEPIC_CHUNK_REF:abc>>> and {BEGIN}a dog{END} end"
    segs = marked_text_segments(tok, text, Markers(), resolve, add_bos=True)
    assert [s.kind.value for s in segs] == ["prompt", "chunk", "prompt", "chunk", "prompt"]
    assert segs[1] == Segment.chunk(doc)
    plain = segments_from_text(tok, f"Q {BEGIN}the river{END} and {BEGIN}a dog{END} end")
    assert segs[2:] == plain[2:] and segs[0] == plain[0]
    with pytest.raises(MarkerError, match="offset 2"):
        marked_text_segments(tok, "Q <<<MEPIC_CHUNK_REF:abc end", Markers(), resolve, True)
    with pytest.raises(MepicRequestError):
        marked_text_segments(tok, "<<<MEPIC_CHUNK_REF:zzz>>> q", Markers(), resolve, True)


def test_client_disconnect_releases_every_block(server, client):
    """A streaming request dropped mid-generation is aborted; its blocks and chunk references
    go back (only idle chunks and cached prefix blocks remain)."""
    body = {
        "prompt": marked(DOCS[1], "Tell a long story."),
        "max_tokens": 800,  # tens of seconds if it were not aborted
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=server, timeout=REQUEST_TIMEOUT_S) as other:
        with other.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_lines()):
                if n >= 3:
                    break  # drop the connection while the request still generates
    deadline = time.monotonic() + 20
    while True:
        m = fresh_stats(client)["metrics"]
        held = m["blocks_prompt_private"] + m["blocks_chunk_first_private"]
        held += m["blocks_compile_scratch"]
        if m["pinned_chunks"] == 0:
            held += m["blocks_chunk_shared_referenced"]
        if held == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.5)
