"""The module path vLLM configurations have named since the first release
(``kv_connector_module_path="kvoffload.impl.vllm_connector"``): the same connector as ``kvoffload.impl.vllm``."""

from .vllm import KVOffloadConnector

__all__ = ["KVOffloadConnector"]
