"""SparseLoCo's message for pseudo-gradients: in each chunk of ``CHUNK`` elements, the ``K``
of largest magnitude, each sent as its place in the chunk and a 2-bit code (its sign, and
whether its magnitude is above the chunk's median of the K); the chunk's two magnitudes (the
mean of each half) go along in fp32. Everything else is dropped, so it is only sound with
error feedback (what was dropped is added to the next round's pseudo-gradient: ft/diloco.py),
which is why it lives here and not among the wire codecs of the job's own collectives
(codecs.py), whose messages must each stand on their own.

K is 3/8 of the chunk: fewer lets the global model lag the groups' (a value waits rounds
for its turn) by more than exact hybrid sharding's loss allows (docs/fault_tolerance.md,
"Loss at equal tokens": 64 of 4096 ended 1.42x exact hybrid's, 1024 1.028x, 1536 1.015x). At
that density the places are cheapest as a bitmap of the chunk (one bit a value) rather than
as indices (16 bits each): a chunk costs CHUNK / 8 (bitmap) + K / 4 (codes) + 8 bytes, 904
bytes for 4096 fp32 values (16 KiB), 18x fewer. Same interface as ``codecs.Codec``
(``nbytes``, ``encode``, ``decode``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK, K = 4096, 1536


class TopK2Bit:
    name = "topk"

    def nbytes(self, numel: int) -> int:
        return _chunks(numel) * (8 + CHUNK // 8 + K // 4)

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
        bitmap = torch.zeros(nc, CHUNK, dtype=torch.uint8, device=x.device).scatter_(1, idx, 1)
        out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        s, b = 8 * nc, 8 * nc + CHUNK // 8 * nc
        out[:s].view(torch.float32).copy_(scales.reshape(-1))
        out[s:b].copy_(_pack(bitmap, 1).reshape(-1))
        out[b:].copy_(_pack(codes, 2).reshape(-1))
        return out

    def decode(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values of a message of ``numel`` elements (zeros where nothing was sent)."""
        nc = _chunks(numel)
        message = message.reshape(-1)[: self.nbytes(numel)].clone()  # (aligned for the views)
        s, b = 8 * nc, 8 * nc + CHUNK // 8 * nc
        scales = message[:s].view(torch.float32).view(nc, 2)
        bitmap = _unpack(message[s:b].view(nc, CHUNK // 8), 1)
        idx = bitmap.nonzero()[:, 1].view(nc, K)  # (row by row, in place order: the codes' order)
        codes = _unpack(message[b:].view(nc, K // 4), 2)
        values = scales.gather(1, (codes >> 1).long()) * (1 - 2 * (codes & 1).float())
        out = torch.zeros(nc, CHUNK, dtype=torch.float32, device=message.device)
        out.scatter_(1, idx, values)
        return out.view(-1)[:numel]


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Rows of ``bits``-bit values (uint8), 8 / bits to a byte, the first in the low bits."""
    per = 8 // bits
    grouped = values.view(values.shape[0], -1, per)
    out = grouped[..., 0].clone()
    for j in range(1, per):
        out |= grouped[..., j] << (bits * j)
    return out


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``_pack``'s inverse."""
    per, mask = 8 // bits, (1 << bits) - 1
    return torch.stack([(packed >> (bits * j)) & mask for j in range(per)], dim=2).view(packed.shape[0], -1)


def _chunks(numel: int) -> int:
    return max(1, -(-numel // CHUNK))


def _mean_where(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(1) / mask.sum(1).clamp(min=1)
