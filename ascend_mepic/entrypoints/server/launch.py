"""``ascend-mepic serve``: vLLM's OpenAI server started with MEPIC's plugins allowed and MEPIC's
server defaults (scheduler, worker, prefix caching, stats file) filled in.
"""

import atexit
import json
import logging
import os
import shutil
import tempfile
from argparse import Namespace
from collections.abc import MutableMapping, Sequence
from importlib.metadata import entry_points

from ascend_mepic.config import STATS_FILE_ENV, MepicConfig
from ascend_mepic.entrypoints.plugins import (
    ENDPOINT_ENTRY_POINT,
    ENDPOINT_PLUGINS_GROUP,
    PLUGIN_NAME,
    allow_mepic_plugins,
)
from ascend_mepic.offline import worker_cls_for_platform
from ascend_mepic.vllm_integration.class_names import (
    CPU_WORKER_CLS,
    NPU_WORKER_CLS,
    SCHEDULER_CLS,
)
from ascend_mepic.vllm_integration.version import check_vllm_version

logger = logging.getLogger(__name__)

CPU_BLOCK_SIZE = 32


def endpoint_plugin_installed() -> bool:
    return any(
        ep.name == PLUGIN_NAME and ep.value == ENDPOINT_ENTRY_POINT
        for ep in entry_points(group=ENDPOINT_PLUGINS_GROUP)
    )


def apply_mepic_defaults(
    args: Namespace, is_cpu: bool, environ: MutableMapping[str, str] = os.environ
) -> str | None:
    """Fill in MEPIC's server options the user left unset; returns a temp dir to remove.

    User-given values win, except those MEPIC cannot work with (an error says which). Without a
    ``stats_file`` option the server's stats file is a fresh one in the returned temp dir, named
    in ``environ`` (``config.STATS_FILE_ENV``) rather than in ``additional_config``, so that the
    engine configuration, and with it vLLM's compile cache key, is the same at every start.
    """
    if args.scheduler_cls is None:
        args.scheduler_cls = SCHEDULER_CLS
    elif args.scheduler_cls != SCHEDULER_CLS:
        logger.warning("--scheduler-cls %s: it must subclass MepicScheduler", args.scheduler_cls)
    if args.worker_cls in (None, "auto"):
        args.worker_cls = CPU_WORKER_CLS if is_cpu else worker_cls_for_platform()
    if args.enable_prefix_caching is False:
        raise ValueError("MEPIC needs prefix caching; drop --no-enable-prefix-caching")
    args.enable_prefix_caching = True
    if getattr(args, "async_scheduling", None):
        raise ValueError(
            "MEPIC does not run with async scheduling (its step plan must describe the step the "
            "worker runs next); drop --async-scheduling"
        )
    args.async_scheduling = False  # vLLM 0.30.0's default is on outside the CPU platform
    if is_cpu and args.block_size is None:
        args.block_size = CPU_BLOCK_SIZE
    if args.worker_cls == NPU_WORKER_CLS and not args.enforce_eager:
        logger.info("MEPIC on Ascend runs in eager mode: setting --enforce-eager")
        args.enforce_eager = True
    additional = args.additional_config or {}
    if isinstance(additional, str):
        additional = json.loads(additional)
    additional = dict(additional)
    mepic = additional.get("mepic") or {}
    if not isinstance(mepic, dict):
        raise ValueError(f'additional_config["mepic"] must be an object, got {mepic!r}')
    mepic = dict(mepic)
    temp_dir = None
    if not mepic.get("stats_file"):
        mepic.pop("stats_file", None)
        temp_dir = tempfile.mkdtemp(prefix="ascend-mepic-")
        environ[STATS_FILE_ENV] = os.path.join(temp_dir, "stats.json")
    additional["mepic"] = mepic
    MepicConfig.from_additional_config(additional)  # unknown options fail now, not later
    args.additional_config = additional
    return temp_dir


def serve(argv: Sequence[str]) -> None:
    """``ascend-mepic serve MODEL [vLLM server options]``: vLLM's OpenAI server, MEPIC on."""
    check_vllm_version()
    allow_mepic_plugins()  # before vLLM reads it anywhere
    from vllm.platforms import current_platform

    from ascend_mepic.vllm_integration.openai_launcher import (
        FlexibleArgumentParser,
        cli_env_setup,
        make_arg_parser,
        serve_command,
        validate_parsed_serve_args,
    )

    cli_env_setup()
    parser = make_arg_parser(
        FlexibleArgumentParser(
            prog="ascend-mepic serve", description="vLLM's OpenAI server with MEPIC on"
        )
    )
    args = parser.parse_args(list(argv))
    if args.model_tag is not None:
        args.model = args.model_tag
    if not endpoint_plugin_installed():
        raise RuntimeError(
            f"the {ENDPOINT_PLUGINS_GROUP} entry point {PLUGIN_NAME} = {ENDPOINT_ENTRY_POINT} "
            "is not installed; reinstall the package (pip install -e .)"
        )
    temp_dir = apply_mepic_defaults(args, is_cpu=current_platform.is_cpu())
    if temp_dir is not None:
        atexit.register(shutil.rmtree, temp_dir, True)
    logger.info("MEPIC config: %s", json.dumps(args.additional_config["mepic"]))
    validate_parsed_serve_args(args)
    # `vllm serve`'s own command body: one API server in this process, or with
    # --api-server-count N several (and prometheus' multiprocess mode) under vLLM's manager.
    serve_command(args)
