"""Error feedback for DiLoCo's encoded pseudo-gradients (Note [error feedback across rounds]
in ft/diloco.py): the encoding ("int8": shardwise's blockwise int8, codecs.py; "topk":
SparseLoCo's top-k with 2-bit values, ft/topk.py), this rank's residual per parameter (kept in
the outer optimizer's state, so that its checkpoint saves it) and the exchange: each group's
message all-gathered, decoded and averaged here."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core.codecs import Codec
from ..core.errors import ShardwiseError
from .topk import TopK2Bit

if TYPE_CHECKING:
    from .across import Across


class Feedback:
    """The residuals of ``params`` (in ``outer``'s state, as ``"residual"``) and the exchange
    encoded by ``codec``."""

    def __init__(self, codec, outer: torch.optim.Optimizer, params: list[torch.Tensor]):
        self.codec, self.outer, self.params = codec, outer, params

    def exchange(self, groups: Across, flat: torch.Tensor, piece: range | None, sitting_out: bool) -> Exchange:
        """Issue the groups' average of ``flat`` (this group's share of a fragment's
        pseudo-gradient; ``piece``: its parameters, all where None), each group sending it
        encoded with its residual added; once waited for, ``flat`` holds the average, or is
        left as it was where the exchange met an error (reported to the manager: the sync does
        not commit). A rank that sits the sync out sends zeros and keeps its residual for a
        sync it takes part in."""
        n = flat.numel()
        if sitting_out:
            message = self.codec.encode(flat)
        else:
            keep = flat + self.residual(piece)
            message = self.codec.encode(keep)
            self.set_residual(keep - self.codec.decode(message, n), piece)
        return Exchange(groups.gather(message), self.codec, flat)

    def residual(self, piece: range | None = None) -> torch.Tensor:
        """This rank's residual of a fragment (all parameters where None), flat in fp32."""
        params = self._of(piece)
        parts = [self.outer.state[p].get("residual") for p in params]
        return torch.cat([
            (r.float() if r is not None else torch.zeros_like(p, dtype=torch.float32)).reshape(-1)
            for r, p in zip(parts, params, strict=True)
        ]) if params else torch.zeros(0)

    def set_residual(self, flat: torch.Tensor, piece: range | None = None) -> None:
        offset = 0
        for p in self._of(piece):
            self.outer.state[p]["residual"] = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def _of(self, piece: range | None) -> list[torch.Tensor]:
        return self.params if piece is None else [self.params[i] for i in piece]


class Exchange:
    """An encoded exchange in flight (``Feedback.exchange``): the messages travel over the
    manager's process group, apart from the job's, while the inner steps go on; ``wait``
    decodes them and leaves their average in ``flat``."""

    def __init__(self, gathering, codec, flat: torch.Tensor):
        self.gathering, self.codec, self.flat = gathering, codec, flat

    def wait(self) -> bool:
        received = self.gathering.wait()
        if received is None:
            return False
        n = self.flat.numel()
        self.flat.zero_()
        for r in received:
            self.flat.add_(self.codec.decode(r, n))
        self.flat.div_(len(received))
        return True


def codec_of(comm: str | None):
    """The encoding of the pseudo-gradients: None (fp32), "int8" (shardwise's blockwise int8,
    codecs.py) or "topk" (SparseLoCo's top-k with 2-bit values, ft/topk.py)."""
    if comm is None:
        return None
    if comm == "int8":
        return Codec("int8")
    if comm == "topk":
        return TopK2Bit()
    raise ShardwiseError(f"ft.diloco(comm={comm!r}): one of None (fp32), 'int8' or 'topk'")
