"""vLLM's OpenAI server launcher as ``ascend-mepic serve`` uses it (vLLM 0.30.0's paths):
imported only when a server starts, since the launcher pulls in uvicorn and the whole front end.
"""

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = [
    "FlexibleArgumentParser",
    "cli_env_setup",
    "make_arg_parser",
    "serve_command",
    "validate_parsed_serve_args",
]

# `vllm serve`'s command body: the single-server launcher, or vLLM's multi-API-server manager for
# --api-server-count above one (it also sets up prometheus' multiprocess directory).
serve_command = ServeSubcommand.cmd
