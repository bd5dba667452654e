"""SparseLoCo's message for pseudo-gradients: in each chunk of ``CHUNK`` elements, the ``K``
of largest magnitude, each sent as its index in the chunk and a 2-bit code (its sign, and
whether its magnitude is above the chunk's median of the K); the chunk's two magnitudes (the
mean of each half) go along in fp32. Everything else is dropped, so it is only sound with
error feedback (what was dropped is added to the next round's pseudo-gradient: ft/diloco.py),
which is why it lives here and not among the wire codecs of the job's own collectives
(codecs.py), whose messages must each stand on their own.

A chunk costs 2 K (int16 indices) + K / 4 (codes) + 8 bytes: 152 bytes for 4096 fp32 values
(16 KiB), 108x fewer. Same interface as ``codecs.Codec`` (``nbytes``, ``encode``, ``decode``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK, K = 4096, 64


class TopK2Bit:
    name = "topk"

    def nbytes(self, numel: int) -> int:
        return _chunks(numel) * (8 + 2 * K + K // 4)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The message (uint8, ``nbytes(x.numel())``) for the 1-D ``x``."""
        n = x.numel()
        nc = _chunks(n)
        chunks = F.pad(x.reshape(-1).float(), (0, nc * CHUNK - n)).view(nc, CHUNK)
        idx = chunks.abs().topk(K, dim=1).indices.sort(dim=1).values
        picked = chunks.gather(1, idx)
        mag = picked.abs()
        high = mag >= mag.median(dim=1, keepdim=True).values
        scales = torch.stack([_mean_where(mag, ~high), _mean_where(mag, high)], dim=1)
        codes = (picked < 0).to(torch.uint8) | (high.to(torch.uint8) << 1)
        packed = codes.view(nc, K // 4, 4)
        packed = packed[..., 0] | packed[..., 1] << 2 | packed[..., 2] << 4 | packed[..., 3] << 6
        out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        s, i = 8 * nc, 8 * nc + 2 * K * nc
        out[:s].view(torch.float32).copy_(scales.reshape(-1))
        out[s:i].view(torch.int16).copy_(idx.reshape(-1))
        out[i:].copy_(packed.reshape(-1))
        return out

    def decode(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values of a message of ``numel`` elements (zeros where nothing was sent)."""
        nc = _chunks(numel)
        message = message.reshape(-1)[: self.nbytes(numel)].clone()  # (aligned for the views)
        s, i = 8 * nc, 8 * nc + 2 * K * nc
        scales = message[:s].view(torch.float32).view(nc, 2)
        idx = message[s:i].view(torch.int16).view(nc, K).long()
        packed = message[i:].view(nc, K // 4)
        codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=2).view(nc, K)
        values = scales.gather(1, (codes >> 1).long()) * (1 - 2 * (codes & 1).float())
        out = torch.zeros(nc, CHUNK, dtype=torch.float32, device=message.device)
        out.scatter_(1, idx, values)
        return out.view(-1)[:numel]


def _chunks(numel: int) -> int:
    return max(1, -(-numel // CHUNK))


def _mean_where(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(1) / mask.sum(1).clamp(min=1)
