"""SparseLoCo's message for pseudo-gradients, its top-k taken over the whole message: of
a message's ``CHUNK``-element chunks, the ``K`` times as many values of largest magnitude in
all of it (each chunk sends those it holds, K on average), each sent as its place in its
chunk and a 2-bit code (its sign, and whether its magnitude is in the chunk's high or low
group); each chunk's two magnitudes go along in fp32. Everything else is dropped, so it is
only sound with error feedback (what was dropped is added to the next round's
pseudo-gradient: ft/diloco.py), which is why it lives here and not among the wire codecs of
the job's own collectives (codecs.py), whose messages must each stand on their own.

K is 3/8 of a chunk: fewer lets the global model lag the groups' (a value waits rounds for
its turn) by more than exact hybrid sharding's loss allows (docs/fault_tolerance.md, "Loss
at equal tokens"). The top-k is the message's rather than each chunk's so that the values
that lag most go first wherever they are (a chunk of small values waits rather than send
3/8 of them): at the same bytes, the loss at the end went from 1.015x, 1.031x, 1.037x and
1.029x exact hybrid's (seeds 0 to 3, the top-k of each chunk) to 1.013x, 1.019x, 1.026x and
1.026x (int8: 1.002x to 1.014x). The two magnitudes
are Lloyd's: the split between the groups moved to the midpoint of their means, a few
times (less error than the median split). At that density the places are cheapest as a
bitmap of the chunk (one bit a value) rather than as indices (16 bits each): a chunk costs
CHUNK / 8 (bitmap) + K / 4 (codes) + 8 bytes, 904 bytes for 4096 fp32 values (16 KiB), 18x
fewer. Same interface as ``codecs.Codec`` (``nbytes``, ``encode``, ``decode``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK, K = 4096, 1536
LLOYD_STEPS = 3  # (moves of the split between a chunk's two magnitudes)


class TopK2Bit:
    name = "topk"

    def nbytes(self, numel: int) -> int:
        return _chunks(numel) * (8 + CHUNK // 8 + K // 4)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The message (uint8, ``nbytes(x.numel())``) for the 1-D ``x``."""
        n = x.numel()
        nc = _chunks(n)
        flat = F.pad(x.reshape(-1).float(), (0, nc * CHUNK - n))
        kept = _largest(flat.abs(), K * nc)
        idx = kept.nonzero().view(-1)  # (in place order: the codes' order)
        picked = flat[idx]
        mag, row = picked.abs(), idx // CHUNK
        split = _group_means(mag, row, torch.zeros_like(row), nc)[:, 0]  # (first, each chunk's mean)
        for _ in range(LLOYD_STEPS):
            high = (mag >= split[row]).long()
            split = _group_means(mag, row, high, nc).mean(dim=1)
        high = (mag >= split[row]).long()
        scales = _group_means(mag, row, high, nc)
        codes = (picked < 0).to(torch.uint8) | (high.to(torch.uint8) << 1)
        out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        s, b = 8 * nc, 8 * nc + CHUNK // 8 * nc
        out[:s].view(torch.float32).copy_(scales.reshape(-1))
        out[s:b].copy_(_pack(kept.view(nc, CHUNK).to(torch.uint8), 1).reshape(-1))
        out[b:].copy_(_pack(codes.view(1, -1), 2).reshape(-1))
        return out

    def decode(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values of a message of ``numel`` elements (zeros where nothing was sent)."""
        nc = _chunks(numel)
        message = message.reshape(-1)[: self.nbytes(numel)].clone()  # (aligned for the views)
        s, b = 8 * nc, 8 * nc + CHUNK // 8 * nc
        scales = message[:s].view(torch.float32).view(nc, 2)
        places = _unpack(message[s:b].view(nc, CHUNK // 8), 1).view(-1).nonzero().view(-1)  # (in place order)
        codes = _unpack(message[b:].view(1, -1), 2).view(-1)
        values = scales[places // CHUNK, (codes >> 1).long()] * (1 - 2 * (codes & 1).float())
        out = torch.zeros(nc * CHUNK, dtype=torch.float32, device=message.device)
        out[places] = values
        return out[:numel]


def _largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """The mask of ``k`` of the largest ``mag`` (of ties at the k-th, the first in place order):
    a selection, not a sort (``topk`` and sorting its indices were several times slower)."""
    kth = mag.kthvalue(mag.numel() - k + 1).values
    above = mag > kth
    ties = mag == kth
    return above | (ties & (ties.cumsum(0) <= k - above.sum()))


def _group_means(values: torch.Tensor, row: torch.Tensor, group: torch.Tensor, rows: int) -> torch.Tensor:
    """(rows, 2): the mean of ``values`` in each (row, group) (0 where none)."""
    at = row * 2 + group
    sums = torch.zeros(rows * 2, dtype=values.dtype, device=values.device).index_add_(0, at, values)
    counts = torch.zeros(rows * 2, dtype=values.dtype, device=values.device).index_add_(0, at, torch.ones_like(values))
    return (sums / counts.clamp(min=1)).view(rows, 2)


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
