"""Put MEPIC's HTTP routes in front of vLLM's own (vLLM 0.30.0's ``attach_endpoint_plugins``).

Why: MEPIC's ``POST /v1/completions`` and ``/v1/chat/completions`` must replace vLLM's, because
they parse chunk markers before the request reaches the engine. vLLM 0.30.0 attaches endpoint
plugins after its core routers and Starlette serves the first matching route, so an appended
route with the same path and method would never run. This removes the core ``APIRoute`` that has
the same path and method as a route of ``router`` before including ``router``.
"""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute


def include_router_replacing(app: FastAPI, router: APIRouter) -> list[str]:
    """Include ``router`` in ``app``; core routes it redefines are removed. Returns those."""
    ours = {
        (route.path, method)
        for route in router.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }
    replaced: list[str] = []
    kept = []
    for route in app.router.routes:
        if isinstance(route, APIRoute) and any((route.path, m) in ours for m in route.methods):
            replaced.append(f"{','.join(sorted(route.methods))} {route.path}")
            continue
        kept.append(route)
    app.router.routes[:] = kept
    app.include_router(router)
    return replaced
