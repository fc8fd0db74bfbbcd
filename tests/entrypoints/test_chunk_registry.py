"""The explicit chunk registry: registrations of one chunk are counted, not overwritten.

Two clients registering the same document get the same id; one deleting it must not break the
other. These run without a server: the registry alone, then the HTTP routes over a stub engine.
"""

import asyncio
import random
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ascend_mepic.core.policies import parse_policy
from ascend_mepic.core.segments import PIN_KEY, UNPIN_KEY
from ascend_mepic.entrypoints.server import (
    ChunkRegistry,
    MepicRequestError,
    MepicService,
    RegisteredChunk,
    chunk_ref,
    chunk_ref_id,
    router,
)


def _chunk(tokens=(5, 6, 7), salt=None) -> RegisteredChunk:
    return RegisteredChunk(chunk_ref_id(tokens, salt), tuple(tokens), salt, time.time())


class FakeEngine:
    """Pin state per chunk id, with pin/unpin calls that yield to the loop in between."""

    def __init__(self, delay: bool = True) -> None:
        self.pinned: dict[str, bool] = {}
        self.calls: list[tuple[str, str]] = []
        self.delay = delay
        self.fail_next: str | None = None

    async def _step(self) -> None:
        for _ in range(random.randint(1, 3) if self.delay else 0):
            await asyncio.sleep(0)

    async def pin(self, chunk: RegisteredChunk) -> None:
        await self._step()
        if self.fail_next == "pin":
            self.fail_next = None
            raise MepicRequestError("engine rejected the pin")
        self.calls.append(("pin", chunk.id))
        self.pinned[chunk.id] = True

    async def unpin(self, chunk: RegisteredChunk) -> None:
        await self._step()
        if self.fail_next == "unpin":
            self.fail_next = None
            raise MepicRequestError("engine rejected the unpin")
        self.calls.append(("unpin", chunk.id))
        self.pinned[chunk.id] = False


def test_two_holders_one_delete_keeps_the_chunk():
    async def main() -> None:
        reg, engine = ChunkRegistry(), FakeEngine()
        a, b = _chunk(), _chunk()  # two clients, the same document
        got_a, n_a = await reg.register(a, engine.pin)
        got_b, n_b = await reg.register(b, engine.pin)
        assert (n_a, n_b) == (1, 2) and got_a is got_b is a
        assert engine.calls == [("pin", a.id)]  # pinned once, by the first holder

        assert await reg.release(a.id, engine.unpin) == (a, 1)
        assert reg.get(a.id) is a and a.id in reg and reg.holders(a.id) == 1
        assert engine.pinned[a.id] is True  # the other client's chunk is still pinned

        assert await reg.release(a.id, engine.unpin) == (a, 0)
        assert reg.get(a.id) is None and len(reg) == 0 and reg.holders(a.id) == 0
        assert engine.calls == [("pin", a.id), ("unpin", a.id)]
        assert await reg.release(a.id, engine.unpin) is None  # unknown now
        assert reg._locks == {}

    asyncio.run(main())


def test_failed_pin_registers_nothing_and_failed_unpin_keeps_the_holder():
    async def main() -> None:
        reg, engine = ChunkRegistry(), FakeEngine()
        c = _chunk()
        engine.fail_next = "pin"
        with pytest.raises(MepicRequestError):
            await reg.register(c, engine.pin)
        assert c.id not in reg and reg.holders(c.id) == 0

        await reg.register(c, engine.pin)
        engine.fail_next = "unpin"
        with pytest.raises(MepicRequestError):
            await reg.release(c.id, engine.unpin)
        assert reg.get(c.id) is c and reg.holders(c.id) == 1  # the delete can be retried
        assert await reg.release(c.id, engine.unpin) == (c, 0)
        assert engine.pinned[c.id] is False and reg._locks == {}

    asyncio.run(main())


def test_delete_racing_a_register_leaves_registry_and_engine_in_step():
    """The last holder's unpin is in flight when another client registers: without the lock the
    registry would keep the chunk while the engine unpins it after the new pin."""

    async def main() -> None:
        reg, engine = ChunkRegistry(), FakeEngine()
        c = _chunk()
        await reg.register(c, engine.pin)
        released, registered = await asyncio.gather(
            reg.release(c.id, engine.unpin), reg.register(_chunk(), engine.pin)
        )
        assert released == (c, 0) and registered[1] == 1
        assert c.id in reg and reg.holders(c.id) == 1
        assert engine.pinned[c.id] is True
        assert engine.calls == [("pin", c.id), ("unpin", c.id), ("pin", c.id)]

    asyncio.run(main())


def test_concurrent_registers_and_deletes_keep_counts():
    async def main() -> None:
        random.seed(1)
        reg, engine = ChunkRegistry(), FakeEngine()
        docs = [_chunk((i, i + 1, i + 2)) for i in range(4)] + [_chunk((0, 1, 2), salt="t")]
        # Every client registers its document, uses it, then deletes it: many clients, shuffled.
        held = {c.id: 0 for c in docs}
        seen_unknown: list[str] = []

        async def client(doc: RegisteredChunk) -> None:
            await reg.register(_chunk(doc.token_ids, doc.cache_salt), engine.pin)
            held[doc.id] += 1
            for _ in range(random.randint(0, 3)):
                await asyncio.sleep(0)
                if reg.get(doc.id) is None or not engine.pinned.get(doc.id):
                    seen_unknown.append(doc.id)  # the soak's failure: gone while held
            held[doc.id] -= 1
            assert await reg.release(doc.id, engine.unpin) is not None

        clients = [client(docs[i % len(docs)]) for i in range(60)]
        random.shuffle(clients)
        # Some long-lived holders register before and release after everything else.
        for d in docs[:2]:
            await reg.register(d, engine.pin)
        await asyncio.gather(*clients)
        assert seen_unknown == []
        assert {d.id for d in reg.values()} == {d.id for d in docs[:2]}
        assert all(reg.holders(d.id) == 1 for d in docs[:2])
        assert all(engine.pinned[d.id] for d in docs[:2])
        assert not any(engine.pinned[d.id] for d in docs[2:])
        for d in docs[:2]:
            assert await reg.release(d.id, engine.unpin) == (d, 0)
        assert len(reg) == 0 and reg._locks == {}
        # Per chunk, the engine saw alternating pin/unpin, never two pins or unpins in a row.
        for d in docs:
            kinds = [k for k, cid in engine.calls if cid == d.id]
            assert kinds and kinds[0] == "pin" and kinds[-1] == "unpin"
            assert all(x != y for x, y in zip(kinds[:-1], kinds[1:], strict=True)), kinds

    asyncio.run(main())


# ---------------------------------------------------------------- the HTTP routes, stub engine


class _Model:
    def get_vocab_size(self) -> int:
        return 1000


def _app() -> tuple[FastAPI, list[tuple[str, tuple[int, ...]]]]:
    """The MEPIC router over a service whose engine control calls are recorded, not run."""
    service = MepicService.__new__(MepicService)
    service.registry = ChunkRegistry()
    service.block_size = 2
    service.policy = parse_policy("mepic")
    service.engine_client = type("Engine", (), {"model_config": _Model()})()
    controls: list[tuple[str, tuple[int, ...]]] = []

    async def control(chunk, key) -> None:
        await asyncio.sleep(0)
        controls.append(({PIN_KEY: "pin", UNPIN_KEY: "unpin"}[key], tuple(chunk.token_ids)))

    service._control = control
    app = FastAPI()
    app.include_router(router)
    app.state.mepic = service
    return app, controls


def test_chunk_api_counts_registrations_over_http():
    app, controls = _app()
    doc = {"token_ids": [11, 12, 13, 14, 15]}
    with TestClient(app) as http:
        first = http.post("/v1/chunks", json=doc).json()
        second = http.post("/v1/chunks", json=doc).json()
        assert first["id"] == second["id"] and (first["holders"], second["holders"]) == (1, 2)
        assert first["ref"] == chunk_ref(first["id"]) and first["num_tokens"] == 5
        cid = first["id"]
        [listed] = http.get("/v1/chunks").json()["data"]
        assert listed["id"] == cid and listed["holders"] == 2

        r = http.delete(f"/v1/chunks/{cid}")
        assert r.status_code == 200
        assert r.json() == {
            "id": cid,
            "object": "mepic.chunk",
            "deleted": True,
            "removed": False,
            "holders": 1,
        }
        # The other client's reference still resolves.
        assert list(app.state.mepic.resolver(None)(cid)) == doc["token_ids"]
        assert controls == [("pin", tuple(doc["token_ids"]))]

        r = http.delete(f"/v1/chunks/{cid}").json()
        assert r["deleted"] and r["removed"] and r["holders"] == 0
        assert http.get("/v1/chunks").json()["data"] == []
        assert controls[-1] == ("unpin", tuple(doc["token_ids"]))
        assert http.delete(f"/v1/chunks/{cid}").status_code == 404
        with pytest.raises(MepicRequestError, match="unknown chunk id"):
            app.state.mepic.resolver(None)(cid)
        assert http.post("/v1/chunks", json={"token_ids": [5000]}).status_code == 400
