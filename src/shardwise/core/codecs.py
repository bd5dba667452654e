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
``bound`` gives the per-element error bound above; tests derive their tolerances from it. One
object per format (``Codec(name)`` gives it): the blockwise formats share their message and
differ in code type, largest code and rounding.

Pure tensor code: no process group here (collectives.py sends the messages).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import ShardwiseError

BLOCK = 256  # elements per scale


class Codec:
    """One wire format: ``encode`` before a message leaves, ``decode`` after it arrives.

    There is one object per format (``BF16``, ``FP8``, ``INT8``); ``Codec(name)`` is the object
    of a format's name (the one place names are parsed), and formats differ by class, not by
    name."""

    name: str

    def __new__(cls, name: str | None = None) -> Codec:
        if cls is not Codec:  # a format's own class, making its one object
            return super().__new__(cls)
        if name not in _BY_NAME:
            raise ShardwiseError(f"comm format {name!r} is not one of {FORMATS} (or None: exact)")
        return _BY_NAME[name]

    def __repr__(self) -> str:
        return f"Codec({self.name!r})"

    def __reduce__(self):  # unpickled as the one object of its format
        return Codec, (self.name,)

    def nbytes(self, numel: int) -> int:
        """Bytes of the message for ``numel`` elements, scales included."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The message (uint8, ``nbytes(x.numel())``) for ``x``."""
        raise NotImplementedError

    def decode(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values of a message of ``numel`` elements (its first ``nbytes`` bytes)."""
        raise NotImplementedError

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per element of ``x``, the largest error ``decode(encode(x))`` may make."""
        raise NotImplementedError

    def _message(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        """The message's own bytes, where dtype views of them may be taken."""
        message = message.reshape(-1)[: self.nbytes(numel)]
        if message.storage_offset() % 4:  # a row of a rank-major buffer: dtype views need alignment
            message = message.clone()
        return message


class _Bf16(Codec):
    """A plain cast, no scales."""

    name = "bf16"

    def nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1)
        out = torch.empty(self.nbytes(x.numel()), dtype=torch.uint8, device=x.device)
        out.view(torch.bfloat16).copy_(x)
        return out

    def decode(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        return self._message(message, numel).view(torch.bfloat16).float()

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1).float().abs() * 2.0**-8


class _Blockwise(Codec):
    """Blocks of ``BLOCK`` elements, each scaled by its absolute maximum over ``qmax`` (the
    largest code) into 1-byte ``code``s; the message is the fp32 scales, then the codes."""

    code: torch.dtype
    qmax: float

    def nbytes(self, numel: int) -> int:
        return numel + 4 * _blocks(numel)

    def _round(self, q: torch.Tensor) -> torch.Tensor:
        """Values in [-qmax, qmax] as the codes will hold them (a cast to ``code`` follows)."""
        return q

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Scales are computed in fp32."""
        x = x.reshape(-1)
        n = x.numel()
        out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        nb = _blocks(n)
        scales, codes = out[: 4 * nb].view(torch.float32), out[4 * nb :].view(self.code)
        # whole blocks as one view, the last partial one apart: no padded copy of the message
        for xs, ss, cs in _block_parts(x.float(), scales, codes):
            # absmax as the larger of -min and max: two reductions cost a seventh of one
            # vector_norm(inf) (measured on CPU, torch 2.13)
            torch.maximum(xs.amax(1), xs.amin(1).neg_(), out=ss)
            ss.div_(self.qmax)
            # an all-zero block keeps scale 0 and codes 0 (decoded exactly); divide by 1 there
            q = xs / torch.where(ss > 0, ss, 1.0)[:, None]
            q.clamp_(-self.qmax, self.qmax)
            cs.copy_(self._round(q))
        return out

    def decode(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        message = self._message(message, numel)
        nb = _blocks(numel)
        scales, codes = message[: 4 * nb].view(torch.float32), message[4 * nb :].view(self.code)
        values = codes.float()
        for vs, ss, _ in _block_parts(values, scales, values):
            vs.mul_(ss[:, None])
        return values

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        """Per element of ``x`` (1-D, fp32), its block's scale."""
        n, nb = x.numel(), _blocks(x.numel())
        absmax = F.pad(x.abs(), (0, nb * BLOCK - n)).view(nb, BLOCK).amax(1)
        return (absmax / self.qmax).repeat_interleave(BLOCK)[:n]


class _Int8(_Blockwise):
    """code = round(x / s), s = absmax / 127."""

    name, code, qmax = "int8", torch.int8, 127.0

    def _round(self, q: torch.Tensor) -> torch.Tensor:
        return q.round_()

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        # s / 2, and fp32's rounding of x / s and of code * s, up to 2^-24 of |x| <= 127 s each
        return self._scale(x.reshape(-1).float()) / 2 * (1 + 2.0**-14)


class _Fp8(_Blockwise):
    """code = float8_e4m3fn(x / s), s = absmax / 448 (e4m3's largest value)."""

    name, code, qmax = "fp8", torch.float8_e4m3fn, 448.0

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        # 3 mantissa bits: 2^-4 relative, or 2^-10 s where x / s is subnormal
        x = x.reshape(-1).float()
        return x.abs() * 2.0**-4 + self._scale(x) * 2.0**-10


BF16, FP8, INT8 = _Bf16(), _Fp8(), _Int8()
_BY_NAME = {c.name: c for c in (BF16, FP8, INT8)}
FORMATS = tuple(_BY_NAME)  # the names: "bf16", "fp8", "int8"


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

