"""Low precision on the wire: encode a tensor into the bytes of one message, decode it back.

A codec turns a 1-D floating-point tensor into one flat uint8 message and back. The blockwise
formats cut the tensor into blocks of ``BLOCK`` elements and scale each block by its own
absolute maximum, so that one large value costs precision only in its own block (ZeRO++'s
blockwise int8 weights, torchao's per-block fp8 scales). A message is the fp32 scales, then
the 1-byte codes:

- ``int8``: code = round(x / s), s = absmax / 127: error at most s / 2 per element;
- ``fp8``: code = float8_e4m3fn(x / s), s = absmax / 448 (e4m3's largest value): 3 mantissa
  bits, so a relative error of at most 2^-4, or an absolute 2^-10 s where x / s is subnormal;
- ``bf16``: a plain cast, no scales: a relative error of at most 2^-8.

So int8 and fp8 send n + 4 ceil(n / 256) bytes for n elements (0.254x of fp32), bf16 2n.
``bound`` gives the per-element error bound above; tests derive their tolerances from it.

Pure tensor code: no process group here (collectives.py sends the messages).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import ShardwiseError

BLOCK = 256  # elements per scale
FORMATS = ("bf16", "fp8", "int8")
_QMAX = {"int8": 127.0, "fp8": 448.0}
_CODE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


class Codec:
    """One wire format (``FORMATS``): ``encode`` before a message leaves, ``decode`` after it
    arrives."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        if name not in FORMATS:
            raise ShardwiseError(f"comm format {name!r} is not one of {FORMATS} (or None: exact)")
        self.name = name

    def __repr__(self) -> str:
        return f"Codec({self.name!r})"

    @property
    def blockwise(self) -> bool:
        return self.name != "bf16"

    def nbytes(self, numel: int) -> int:
        """Bytes of the message for ``numel`` elements, scales included."""
        if not self.blockwise:
            return 2 * numel
        return numel + 4 * _blocks(numel)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The message (uint8, ``nbytes(x.numel())``) for ``x``; scales are computed in fp32."""
        x = x.reshape(-1)
        n = x.numel()
        out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        if not self.blockwise:
            out.view(torch.bfloat16).copy_(x)
            return out
        nb = _blocks(n)
        scales, codes = out[: 4 * nb].view(torch.float32), out[4 * nb :].view(_CODE[self.name])
        qmax = _QMAX[self.name]
        # whole blocks as one view, the last partial one apart: no padded copy of the message
        for xs, ss, cs in _block_parts(x.float(), scales, codes):
            # absmax as the larger of -min and max: two reductions cost a seventh of one
            # vector_norm(inf) (measured on CPU, torch 2.13)
            torch.maximum(xs.amax(1), xs.amin(1).neg_(), out=ss)
            ss.div_(qmax)
            # an all-zero block keeps scale 0 and codes 0 (decoded exactly); divide by 1 there
            q = xs / torch.where(ss > 0, ss, 1.0)[:, None]
            q.clamp_(-qmax, qmax)
            cs.copy_(q.round_() if self.name == "int8" else q)
        return out

    def decode(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values of a message of ``numel`` elements (its first ``nbytes`` bytes)."""
        message = message.reshape(-1)[: self.nbytes(numel)]
        if message.storage_offset() % 4:  # a row of a rank-major buffer: dtype views need alignment
            message = message.clone()
        if not self.blockwise:
            return message.view(torch.bfloat16).float()
        nb = _blocks(numel)
        scales, codes = message[: 4 * nb].view(torch.float32), message[4 * nb :].view(_CODE[self.name])
        values = codes.float()
        for vs, ss, _ in _block_parts(values, scales, values):
            vs.mul_(ss[:, None])
        return values

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per element of ``x``, the largest error ``decode(encode(x))`` may make."""
        x = x.reshape(-1).float()
        if not self.blockwise:
            return x.abs() * 2.0**-8
        n, nb = x.numel(), _blocks(x.numel())
        absmax = F.pad(x.abs(), (0, nb * BLOCK - n)).view(nb, BLOCK).amax(1)
        scale = (absmax / _QMAX[self.name]).repeat_interleave(BLOCK)[:n]
        if self.name == "int8":
            # (and fp32's rounding of x / s and of code * s, up to 2^-24 of |x| <= 127 s each)
            return scale / 2 * (1 + 2.0**-14)
        return x.abs() * 2.0**-4 + scale * 2.0**-10


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _block_parts(x: torch.Tensor, scales: torch.Tensor, codes: torch.Tensor):
    """``x`` (1-D) as rows of ``BLOCK`` elements with their scales and codes (1-D, as long as
    ``x``): the whole blocks as one 2-D view, then the last, partial one."""
    n = x.numel()
    whole = n // BLOCK
    if whole:
        yield x[: whole * BLOCK].view(whole, BLOCK), scales[:whole], codes[: whole * BLOCK].view(whole, BLOCK)
    if n > whole * BLOCK:
        yield x[whole * BLOCK :].view(1, -1), scales[whole:], codes[whole * BLOCK :].view(1, -1)


def codec(name: str | None) -> Codec | None:
    """The codec of a format name; None (exact) stays None."""
    return None if name is None else Codec(name)
