"""vLLM-shaped KV caches that the conformance kit can write and check: real bytes in every layout."""

from __future__ import annotations

import torch

from ..transfer import block_views

SHAPES = {  # per-layer tensor shape for num_blocks=n, block_size=b, heads=h, head_dim=d
    "kv_first": lambda n, b, h, d: (2, n, b, h, d),  # FlashAttention: K and V split
    "fused": lambda n, b, h, d: (n, 2, b, h, d),  # vLLM's CPU backend
    "mla": lambda n, b, h, d: (n, b, h * d),  # one latent vector per token
    "cross_layer": lambda n, b, h, d: (n, 2, 2, b, h, d),  # one tensor for all (here 2) layers
}


class LayeredKV:
    """GPU KV memory as vLLM hands it to a connector: per-layer tensors (or one cross-layer tensor) of any dtype.
    ``write`` fills a block's spans in every view with bytes derived from its content id; ``holds`` checks them."""

    def __init__(self, num_blocks: int, shape: str = "kv_first", layers: int = 2, block_size: int = 2,
                 heads: int = 2, head_dim: int = 4, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu"):
        dims = SHAPES[shape](num_blocks, block_size, heads, head_dim)
        count = 1 if shape == "cross_layer" else layers
        self.num_blocks = num_blocks
        self.layout = "kv_first" if shape == "kv_first" else "blocks_first"
        self.caches = {f"layer.{i}": torch.zeros(dims, dtype=dtype, device=device) for i in range(count)}
        self.views = block_views(self.caches, self.layout)
        # content's bytes, by (content, width, device): the world checks every live block every step, and building
        # them took a third of a kit run
        self._patterns: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def _bytes(self, content: int, width: int, device: torch.device) -> torch.Tensor:
        pattern = self._patterns.get((content, width, device))
        if pattern is None:
            if len(self._patterns) >= 1 << 16:
                self._patterns.clear()
            lanes = torch.arange(width, dtype=torch.int64, device=device)
            pattern = ((lanes * 0x9E3779B1 + content) >> (lanes % 7 * 8) & 0xFF).to(torch.uint8)
            self._patterns[content, width, device] = pattern
        return pattern

    def write(self, block_id: int, content: int) -> None:
        for view in self.views:
            view[block_id] = self._bytes(content, view.shape[1], view.device)

    def holds(self, block_id: int, content: int) -> bool:
        return all(torch.equal(view[block_id], self._bytes(content, view.shape[1], view.device)) for view in self.views)
