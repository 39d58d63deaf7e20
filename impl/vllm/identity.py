"""An engine's KV identity, derived from what produces the bytes (``kvoffload.spec.records.Namespace``).

Two engines may share a record only if the same tokens give the same KV in both. What decides that:

* **the weights the engine computes with**: every byte of every parameter and buffer of the loaded model, read on
  each worker (its shard) when the engine starts and again at every ``reset_prefix_cache(reset_connector=True)``,
  so that a weight update made in place (``reload_weights``, ``update_weights``, ``apply_model``, a trainer's
  push) is seen as what it is. The buffers hold what the configuration computes too (rotary tables from
  ``rope_theta`` and its scaling);
* **the model's configuration as vLLM runs it**: the whole Hugging Face config after vLLM's overrides
  (``hf_overrides``, rope scaling, quantization config) and vLLM's own hash of the model config (dtype,
  quantization, revision, ...), the attention config (backend) and the KV cache layout;
* the KV dtype and layout, block and hash sizes, the hash algorithm and seed, the shard and the tenant;
* **a request's LoRA adapter**: vLLM's block hashes name it (its name and path), not its bytes, so an adapter
  retrained in place would share the old one's records. Its files' bytes salt the keys of its requests
  (``adapter_salt``).

The weights digest reads a host tensor's bytes with xxh3-128 and folds an accelerator's on its own device: its
bytes, read as 64-bit words, are mixed (a bijection that spreads every bit over the word) and summed per row of
``ROW`` words with a fixed odd multiplier per column (a change of any one word changes its row's sum), and the host
hashes the folded rows, 1/``ROW`` of the bytes. On a GPU that is a dozen passes over the parameters at memory
bandwidth, no copy of them to the host. ``bench/identity.py`` measures both against loading the same weights.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from kvoffload.spec.config import Config
from kvoffload.spec.records import Namespace

ROW = 4096  # words per folded row
CHUNK_ROWS = 2048  # rows folded at a time (64 MiB of words): bounds the temporaries
_MIX = (0xBF58476D1CE4E5B9 - (1 << 64), 0x94D049BB133111EB - (1 << 64))  # splitmix64's multipliers, as int64
_multipliers: dict[torch.device, torch.Tensor] = {}


def _logical_shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x >> bits`` as an unsigned shift (torch shifts int64 arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection of 64-bit words in which every input bit reaches every output bit, so
    that no two changes cancel in a sum by lying in the same high bits (int64 arithmetic wraps)."""
    x = x ^ _logical_shift(x, 30)
    x = x * _MIX[0]
    x = x ^ _logical_shift(x, 27)
    x = x * _MIX[1]
    return x ^ _logical_shift(x, 31)


def _row_multipliers(device: torch.device) -> torch.Tensor:
    """``ROW`` fixed odd int64 multipliers (odd: invertible modulo 2**64), the same on every host."""
    if device not in _multipliers:
        odd = np.random.default_rng(0x6B766F66).integers(0, 1 << 63, ROW, dtype=np.int64) | 1
        _multipliers[device] = torch.from_numpy(odd).to(device)
    return _multipliers[device]


def fold(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes folded to 8 bytes per ``ROW`` words, on its own device; equal bytes fold equally."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() % 8:
        flat = torch.cat([flat, flat.new_zeros(8 - flat.numel() % 8)])
    words, weights = flat.view(torch.int64), _row_multipliers(flat.device)
    full = words.numel() // ROW
    body = words[:full * ROW].view(full, ROW)
    sums = [(_mix(body[i:i + CHUNK_ROWS]) * weights).sum(dim=1) for i in range(0, full, CHUNK_ROWS)]
    tail = words[full * ROW:]
    if tail.numel():
        sums.append((_mix(tail) * weights[:tail.numel()]).sum().reshape(1))
    return torch.cat(sums).cpu().numpy().tobytes() if sums else b""


def tensor_digest(tensor: torch.Tensor, strategy: str | None = None) -> bytes:
    """What stands for a tensor's bytes in the weights digest: on the host, the bytes' xxh3-128 (at memory speed
    there); on an accelerator, ``fold``: only 1/``ROW`` of the bytes cross to the host. ``strategy`` forces one
    ("hash", "fold"), for tests on this machine."""
    import xxhash

    if (strategy or ("hash" if tensor.device.type == "cpu" else "fold")) == "fold":
        return fold(tensor)
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return xxhash.xxh3_128_digest(flat.numpy().data)


def weights_digest(model: torch.nn.Module, strategy: str | None = None) -> str:
    """Every parameter and buffer of ``model`` (this worker's shard), by name, dtype, shape and bytes (``strategy``:
    as ``tensor_digest``)."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    names = sorted(tensors)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # xxhash releases the GIL: one tensor per core at a time
        digests = pool.map(lambda name: tensor_digest(tensors[name], strategy), names)
        digest = hashlib.blake2b(digest_size=16)
        for name, tensor_bytes in zip(names, digests):
            tensor = tensors[name]
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
            digest.update(tensor_bytes)
    return digest.hexdigest()


def combined(digests: dict[int, str]) -> str:
    """One engine's weights from its workers' digests, by rank: every shard's bytes."""
    return hashlib.blake2b(json.dumps(sorted(digests.items())).encode(), digest_size=16).hexdigest()


def config_digest(vllm_config: Any) -> str:
    """The model's configuration as the engine runs it: the Hugging Face config after vLLM applied its overrides,
    vLLM's hash of its model config (less the path it was loaded from), the attention config (backend) and the
    KV cache layout."""
    model = copy.copy(vllm_config.model_config)
    model.model = ""  # a path, which reload_weights rewrites: what it held is in the weights digest
    parts = {"hf_config": model.hf_config.to_json_string(use_diff=False), "model": model.compute_hash(),
             "attention": vllm_config.attention_config.compute_hash(),
             "kv_cache_layout": str(vllm_config.cache_config.kv_cache_layout)}
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=16).hexdigest()


_adapter_salts: dict[tuple, bytes] = {}  # (directory, every file's stat) -> salt


def adapter_salt(directory: str) -> bytes:
    """16 bytes that stand for every byte of every file of a LoRA adapter's ``directory`` (b"" if it is not one:
    vLLM's hash of its name and path is all there is). Kept by each file's size, inode, mtime and ctime: a file
    written again changes its ctime, which no copy or ``touch`` can set back, so the salt never outlives what it
    read."""
    try:
        files = sorted((entry for entry in os.scandir(directory) if entry.is_file()), key=lambda entry: entry.name)
    except OSError:
        return b""
    stats = tuple((f.name, s.st_size, s.st_ino, s.st_mtime_ns, s.st_ctime_ns) for f in files for s in [f.stat()])
    salt = _adapter_salts.get((directory, stats))
    if salt is None:
        digest = hashlib.blake2b(digest_size=16)
        for f in files:
            digest.update(f"{f.name}:{f.stat().st_size}:".encode())
            with open(f.path, "rb") as source:
                digest.update(hashlib.file_digest(source, lambda: hashlib.blake2b(digest_size=16)).digest())
        salt = _adapter_salts[directory, stats] = digest.digest()
    return salt


def salted(block_hash: bytes, salt: bytes) -> bytes:
    """A key of the same length as vLLM's ``block_hash``, other for each ``salt``."""
    return hashlib.blake2b(block_hash, digest_size=len(block_hash), key=salt).digest()


def calling_model_runner() -> Any:
    """The model runner that is registering our KV caches: the first caller up the stack with ``get_model()``
    (vLLM's GPU and CPU model runners call ``register_kv_caches`` themselves, its v2 runner through a helper).
    vLLM hands a connector no model: this is how the worker side reaches the weights it must fingerprint."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if callable(getattr(owner, "get_model", None)):
            return owner
        frame = frame.f_back  # type: ignore[assignment]
    raise LookupError("no model runner on the stack of register_kv_caches: the shared tier cannot fingerprint the "
                      "weights this engine computes with (an unsupported vLLM release?)")


def lora_salt(request: Any) -> bytes:
    """What salts a request's keys: its LoRA adapter's bytes, if its path is a local directory (b"" without an
    adapter; a Hub name is left to vLLM's hash of it: nothing is downloaded on the scheduler's thread)."""
    lora = getattr(request, "lora_request", None)
    return adapter_salt(os.path.abspath(os.path.expanduser(lora.lora_path))) if lora and lora.lora_path else b""


def group_layout(spec: Any) -> str:
    """What a KV cache group's pages hold, as the identity names it: the spec's kind and page size, and for a
    Mamba group its kind of state (Mamba, Mamba2, gated delta net...) and each state tensor's shape and dtype,
    which its page size alone does not tell (vLLM pads state pages to the attention page size)."""
    kind = f"{type(spec).__name__}:{spec.page_size_bytes}"
    if not hasattr(spec, "mamba_type"):
        return kind
    states = ",".join(f"{'x'.join(map(str, shape))}/{dtype}" for shape, dtype in zip(spec.shapes, spec.dtypes))
    return f"{kind}:{spec.mamba_type}[{states}]"


@dataclass
class KVOffloadHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up (vLLM's handshake): the digest of the weights this worker holds."""

    rank: int
    weights: str


def namespace_from_vllm(vllm_config: Any, kv_cache_config: Any, config: Config, tenant: str,
                        weights: str) -> Namespace:
    """The engine's KV identity: ``weights`` (its workers' digests, ``combined``) and what vLLM's
    configuration gives. The hash seed is vLLM's ``NONE_HASH`` itself: read once the engine has set it (after the
    scheduler, and so this connector, was built), it differs between two processes exactly when their block hashes
    do (xxhash without a common ``PYTHONHASHSEED``)."""
    from vllm.v1.core import kv_cache_utils

    model, cache = vllm_config.model_config, vllm_config.cache_config
    layout = ";".join(f"{group_layout(g.kv_cache_spec)}x{len(g.layer_names)}" for g in kv_cache_config.kv_cache_groups)
    dtype = str(model.dtype) if cache.cache_dtype == "auto" else cache.cache_dtype
    return Namespace(model=",".join(model.architectures), weights=weights, config=config_digest(vllm_config),
                     kv_dtype=dtype, kv_layout=layout, block_size=config.offload_block_size,
                     hash_block_size=config.block_size, hash_algorithm=cache.prefix_caching_hash_algo,
                     hash_seed=bytes(kv_cache_utils.NONE_HASH).hex(), tp_rank=0,
                     tp_size=vllm_config.parallel_config.world_size, tenant=tenant)
