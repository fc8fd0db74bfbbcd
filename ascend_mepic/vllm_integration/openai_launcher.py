"""vLLM's OpenAI server launcher as ``ascend-mepic serve`` uses it (vLLM 0.30.0's paths):
imported only when a server starts, since the launcher pulls in uvicorn and the whole front end.
"""

from vllm.entrypoints.launchers.api_server.entry import run_server
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.utils.argparse_utils import FlexibleArgumentParser

__all__ = [
    "FlexibleArgumentParser",
    "cli_env_setup",
    "make_arg_parser",
    "run_server",
    "validate_parsed_serve_args",
]
