"""The offline API's documented import path (``ascend_mepic.offline``); the code lives in
``ascend_mepic.entrypoints.offline``."""

from ascend_mepic.entrypoints.offline import *  # noqa: F401,F403
from ascend_mepic.entrypoints.offline import __all__  # noqa: F401
