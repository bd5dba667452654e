"""The "shardwise" weight-transfer backend on vLLM's side: the engine each inference worker
runs, registered in every vLLM process by the ``vllm.general_plugins`` entry point
(``shardwise.rl.plugin:register``).

A push is vLLM's update life cycle: ``start_weight_update``, one ``update_weights`` per bucket,
``finish_weight_update``. Weights arrive in checkpoint format (the names ``save_pretrained``
writes) and go through the model's own ``load_weights`` inside vLLM's layerwise reload, which
re-runs each layer's post-load processing: on CPU vLLM repacks linear weights for its kernels
and drops the originals, so nothing may be written in place.

- full mode: each tensor is loaded, straight from the bucket, as soon as all of it has
  arrived; a layer whose tensors are all in goes through its post-load processing there. The
  layerwise reload keeps what it is handed until its layer is complete, and the trainer
  refills the bucket once ``update_weights`` returns, so what it still holds of the bucket
  then (the layers a bucket's end cuts) is copied out (``keep_pending``): one copy of those
  tensors instead of one of every tensor.
- delta mode: the engine keeps the last tensors it received (in the wire dtype: a mirror of
  the checkpoint), patches arrive as flat indices with new values or with the steps each
  value moved (``delta``), and ``finish_weight_update`` reloads the patched mirror. Until
  then the model serves the previous version whole.

``init_transfer_engine`` checks every name and shape the trainer declares against the model's
loader before any weight moves (a dry run on the meta device: ``check_names``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import packing
from .delta import BITS
from .transport import transport


@dataclass
class ShardwiseInitInfo(WeightTransferInitInfo):
    """What the trainer's rank 0 sends at the handshake."""

    transport: str  # a shardwise transport's name (transport.TRANSPORTS)
    tensors: list[list[Any]]  # [name, dtype name, shape] of every tensor a push sends
    delta: bool = False
    paths: list[str] = field(default_factory=list)  # shm: the staging buffers' files
    host: str = ""  # tcp: where trainer rank 0 hosts the rendezvous
    port: int = 0
    world_size: int = 0  # tcp: 1 + the engine's workers
    timeout: float = 300.0


@dataclass
class ShardwiseUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: which staging buffer (shm), its length, and its entries (``packing``)."""

    version: int
    bucket: int
    nbytes: int
    entries: list[dict]
    abort: bool = False  # the trainer gave up on this update (finish then closes it)


class ShardwiseWeightTransferEngine(WeightTransferEngine[ShardwiseInitInfo, ShardwiseUpdateInfo]):
    init_info_cls = ShardwiseInitInfo
    update_info_cls = ShardwiseUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.reader = None
        self.declared: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.delta = False
        self.mirror: dict[str, torch.Tensor] = {}  # delta mode: the last tensors received
        self.partial: dict[str, list] = {}  # full mode: [tensor, elements received] per name
        self.changed = False
        self.aborted = False
        self.version = -1

    def init_transfer_engine(self, init_info: ShardwiseInitInfo) -> None:
        self.shutdown()
        self.declared = {n: (packing.dtype_of(d), tuple(s)) for n, d, s in init_info.tensors}
        problems = check_names(self.model, self.declared)
        if problems:
            more = f"\n  ... and {len(problems) - 6} more" if len(problems) > 6 else ""
            raise ValueError(
                f"{len(problems)} of the trainer's tensors do not fit this engine's model (nothing "
                "was sent):\n  " + "\n  ".join(problems[:6]) + more
            )
        self.delta = init_info.delta
        pc = self.parallel_config
        self.reader = transport(init_info.transport).reader(init_info, 1 + pc.data_parallel_index * pc.world_size + pc.rank)

    def start_weight_update(self) -> None:
        if self.reader is None:
            raise RuntimeError("the shardwise weight transfer is not initialised: init_weight_transfer_engine first")
        self.partial, self.changed, self.aborted = {}, False, False
        if not self.delta:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # (the base class synchronizes an accelerator, which a CPU engine has not)
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ShardwiseUpdateInfo) -> None:
        if update_info.abort:
            self.aborted = True
            return
        data = self.reader.receive(update_info.bucket, update_info.nbytes)
        self.version = update_info.version
        pieces = packing.decode(data, update_info.entries)
        for p in pieces:
            self._check(p)
        if self.delta:
            for p in pieces:
                self._patch(p)
            self.changed = True
            return
        ready = [(p.name, p.values.view(p.shape)) for p in pieces if p.whole]
        ready += [t for p in pieces if not p.whole for t in self._gather(p)]
        self._load(ready)
        keep_pending(self.model, data)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.aborted:  # delta: the model was not touched; the mirror is not to be trusted
            self.mirror, self.partial = ({} if self.delta else self.mirror), {}
            if not self.delta:
                self._finalize()
            return
        if self.partial:
            names = ", ".join(sorted(self.partial)[:5])
            raise RuntimeError(f"the push ended with tensors incomplete: {names}")
        if self.delta:
            if not self.changed:
                return
            missing = [n for n in self.declared if n not in self.mirror]
            if missing:
                raise RuntimeError(
                    f"delta mode: no full value yet for {', '.join(missing[:5])} (the first push "
                    "after the handshake must send every tensor)"
                )
            initialize_layerwise_reload(self.model)
            self._load([(n, t.view(self.declared[n][1])) for n, t in self.mirror.items()])
        self._finalize()

    def _finalize(self) -> None:
        """End vLLM's layerwise reload, then the post-load steps vLLM 0.32 skips on a reload."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_experts(self.model)
        reprocess_tied(self.model)

    def shutdown(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        self.mirror, self.partial = {}, {}

    # --- pieces
    def _check(self, p: packing.Piece) -> None:
        want = self.declared.get(p.name)
        if want is None:
            raise ValueError(f"'{p.name}' was not declared at the handshake")
        if want != (p.dtype, p.shape):
            raise ValueError(f"'{p.name}': {p.dtype} {p.shape} arrived, {want[0]} {want[1]} was declared")

    def _gather(self, p: packing.Piece) -> list[tuple[str, torch.Tensor]]:
        """Full mode: a piece of a tensor split across buckets; the tensor once complete."""
        slot = self.partial.get(p.name)
        if slot is None:
            slot = self.partial[p.name] = [torch.empty(math.prod(p.shape), dtype=p.dtype), 0]
        slot[0][p.start : p.start + p.values.numel()].copy_(p.values)
        slot[1] += p.values.numel()
        if slot[1] < slot[0].numel():
            return []
        del self.partial[p.name]
        return [(p.name, slot[0].view(p.shape))]

    def _patch(self, p: packing.Piece) -> None:
        """Delta mode: write a dense piece or a sparse patch into the mirror."""
        flat = self.mirror.get(p.name)
        if flat is None:
            if p.indices is not None:
                raise RuntimeError(f"delta mode: a patch for '{p.name}' arrived before its full value")
            flat = self.mirror[p.name] = torch.empty(math.prod(p.shape), dtype=p.dtype)
        if p.indices is None:
            flat[p.start : p.start + p.values.numel()].copy_(p.values)
        elif p.steps:  # the trainer stepped the same bits it sent before
            bits = flat.view(BITS[flat.element_size()])
            bits[p.indices] += p.values.to(bits.dtype)
        else:
            flat[p.indices] = p.values

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        if not weights:
            return
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(weights)


def keep_pending(model: torch.nn.Module, data: torch.Tensor) -> None:
    """Copy out of ``data`` (a bucket, refilled once the engine returns) every tensor vLLM's
    layerwise reload still holds for a layer not yet complete: it keeps the arguments of each
    weight loader call until the layer's last weight arrives, then loads them all."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    bucket = data.untyped_storage().data_ptr()
    for layer in model.modules():
        info = LAYERWISE_INFO.get(layer)
        for _, call in info.loaded_weights if info is not None else ():
            for name, value in call.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == bucket:
                    call.arguments[name] = value.clone()


def check_names(model: torch.nn.Module, declared: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> list[str]:
    """What would go wrong loading tensors of these names and shapes into ``model``: names its
    loader does not know or rejects (a shape it does not take), and parameters no name fills.

    A dry run: every layer is put back in checkpoint format on the meta device, as vLLM's
    layerwise reload does at the start of an update, the model's own ``load_weights`` is handed
    meta tensors one name at a time (its shape checks run, no data moves), and the layers get
    their kernel tensors back, untouched. Two things the reload leaves alone are matched here:
    a parameter it does not move to meta (a ``bias``: loaded in place) gets a meta stand-in,
    and a parameter tied to another (a tied ``lm_head``, which the loader skips) is filled
    when the one it shares is."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        _get_original_loader,
        get_layerwise_info,
    )
    from vllm.model_executor.model_loader.reload.meta import (
        CopyCounter,
        restore_layer_on_meta,
        to_meta_tensor,
    )

    tied = _tied_names(model)
    kept = []
    for layer in model.modules():
        kept.append((layer, dict(layer._parameters), dict(layer._buffers), set(layer._non_persistent_buffers_set)))
        restore_layer_on_meta(layer, get_layerwise_info(layer))
        for name, p in list(layer._parameters.items()):
            if p is not None and not p.is_meta:
                layer._parameters[name] = to_meta_tensor(p)
    problems, loaded, copied = [], set(), 0
    try:
        for p in model.parameters():
            p.weight_loader = _get_original_loader(p)
        for name, (dtype, shape) in declared.items():
            try:
                with CopyCounter() as counter:
                    got = model.load_weights([(name, torch.empty(shape, dtype=dtype, device="meta"))])
            except Exception as e:  # the loader's own words: unknown name, wrong shape
                words = str(e).split(". ")[0][:160]
                problems.append(f"'{name}' {list(shape)}: {type(e).__name__}: {words}")
                continue
            copied += counter.copied_numel
            if not got:
                problems.append(f"'{name}' {list(shape)}: the engine's loader took nothing from it")
            loaded |= {tied.get(n, n) for n in got or ()}
        params = {n: p for n, p in model.named_parameters() if tied.get(n, n) == n}
        if not problems:
            unfilled = [n for n in params if n not in loaded]
            if unfilled:
                problems.append(f"the trainer sends nothing for the engine's {', '.join(unfilled[:5])}")
            elif copied < sum(p.numel() for p in params.values()):
                total = sum(p.numel() for p in params.values())
                problems.append(f"the trainer's tensors fill {copied} of the engine's {total} parameter elements")
    finally:  # the kernel tensors back, exactly as they were
        for layer, params_, buffers, non_persistent in kept:
            layer._parameters.clear()
            layer._parameters.update(params_)
            layer._buffers.clear()
            layer._buffers.update(buffers)
            layer._non_persistent_buffers_set.clear()
            layer._non_persistent_buffers_set.update(non_persistent)
    return problems


def _tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter name -> the first name of the tensor it shares (itself when not tied)."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}


def repack_experts(model: torch.nn.Module) -> None:
    """Work around vLLM 0.32: after a weight update, an unquantized mixture-of-experts layer
    re-runs its own post-load processing but skips its experts' (``_setup_kernel`` calls
    ``fused_experts.process_weights_after_loading`` on the first load only), which on CPU is
    the prepacking of the expert weights for the grouped kernels: the layer then computes on
    unpacked weights, off by about 1e-2 in logprobs (``reload_weights`` from disk shows the
    same). Run that step, as the first load does."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    for m in model.modules():
        method = getattr(m, "quant_method", None)
        if isinstance(method, UnquantizedFusedMoEMethod) and method.moe_kernel is not None:
            method.moe_kernel.fused_experts.process_weights_after_loading(m)


def reprocess_tied(model: torch.nn.Module) -> None:
    """Work around vLLM 0.32: a layer whose weight is another's (a tied ``lm_head``) is not
    loaded in a reload (its loader skips it), so its post-load processing does not run again,
    and on CPU that processing is what builds the layer's GEMM from the weight (a packed copy
    or a oneDNN handle): the layer keeps computing with the old weights while the tensor holds
    the new ones (vLLM's own ``reload_weights`` does the same). Run it for such layers."""
    tied = _tied_names(model)
    for prefix, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        names = [f"{prefix}.{n}".lstrip(".") for n, _ in layer.named_parameters(recurse=False)]
        if method is not None and any(tied[n] != n for n in names):
            method.process_weights_after_loading(layer)
