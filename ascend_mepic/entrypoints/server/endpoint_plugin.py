"""The ``vllm.endpoint_plugins`` entry, :class:`MepicEndpointPlugin`: how MEPIC joins vLLM's
OpenAI server in the API server process, only when ``--additional-config`` turns MEPIC on.
"""

import json
import logging
from argparse import Namespace
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import State

from ascend_mepic.config import MepicConfig
from ascend_mepic.entrypoints.plugins import PLUGIN_NAME
from ascend_mepic.entrypoints.server.routes import router
from ascend_mepic.entrypoints.server.service import MepicService
from ascend_mepic.vllm_integration.route_override import include_router_replacing

logger = logging.getLogger(__name__)



def mepic_config_from_args(args: Namespace | None) -> MepicConfig:
    """MEPIC's config from the server's ``--additional-config`` (disabled when absent)."""
    additional = getattr(args, "additional_config", None)
    if isinstance(additional, str):
        additional = json.loads(additional) if additional.strip() else {}
    return MepicConfig.from_additional_config(additional or {})


class MepicEndpointPlugin:
    """The ``vllm.endpoint_plugins`` entry: MEPIC's HTTP surface, only when MEPIC is on."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        config = mepic_config_from_args(getattr(app.state, "args", None))
        if not config.enabled:
            logger.info("MEPIC is off (no 'mepic' in --additional-config): no MEPIC routes")
            return
        app.state.mepic_config = config
        replaced = include_router_replacing(app, router)
        logger.info("MEPIC routes in place of vLLM's: %s", ", ".join(replaced) or "none")

    async def init_state(self, engine_client: Any, state: State, args: Namespace) -> None:
        config = getattr(state, "mepic_config", None)
        if config is None or engine_client is None:
            return
        state.mepic = MepicService(engine_client, state, args, config)
        logger.info(
            "MEPIC serving on: markers %r/%r, block size %d, stats %s",
            config.chunk_begin,
            config.chunk_end,
            state.mepic.block_size,
            config.stats_file or "off",
        )
