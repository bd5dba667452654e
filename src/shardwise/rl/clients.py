"""The engine's control plane as trainer rank 0 sees it: vLLM's four weight-sync calls
(``VLLMWeightSyncClient``) on an in-process ``LLM`` or on a ``vllm serve`` URL, plus what a
push needs around them: whether the engine is alive, how many workers it has, and pausing a
server's generation for the length of an update.

``Watched`` runs every call on a thread and, while waiting, asks the engine whether it is
alive: an ``LLM`` whose engine process died never answers a pending call (vLLM's utility
calls wait without a timeout), so a death becomes an ``EngineError`` within a second or two
instead of a hang.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any
from urllib.parse import urlparse

from ..core.errors import ShardwiseError


class EngineError(ShardwiseError):
    """The inference engine refused, failed or died during a handshake or a push. Raised on
    every trainer rank; the model and optimizer are untouched, and the next ``push()`` starts
    over with a new handshake and a full push."""


class LLMClient:
    """An in-process ``vllm.LLM`` (rank 0 runs it beside training)."""

    local = True

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def alive(self) -> None:
        core = getattr(self.llm.llm_engine, "engine_core", None)
        ensure = getattr(core, "ensure_alive", None)
        if ensure is not None:
            ensure()

    def workers(self) -> int:
        return self.llm.llm_engine.vllm_config.parallel_config.world_size_across_dp

    def dtype(self) -> str:
        return str(self.llm.llm_engine.vllm_config.model_config.dtype)

    def pause(self) -> None:
        """Nothing to pause: an ``LLM`` generates only when rank 0 asks it to."""

    def resume(self) -> None:
        pass


class ServerClient:
    """A ``vllm serve`` reached by URL (its RL routes need ``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, url: str, timeout: float):
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        class _Http(HTTPVLLMWeightSyncClient):
            def _post(self, path: str, json: dict | None = None) -> None:
                import requests

                r = requests.post(f"{self.base_url}/{path}", json=json, timeout=self.timeout)
                _raise_for(r, self.base_url, path)

        self.url = url.rstrip("/")
        self.http = _Http(self.url, timeout=timeout)
        host = urlparse(self.url).hostname or ""
        self.local = host in ("localhost", "127.0.0.1", "::1")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.http.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.http.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.http.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.http.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.http.shutdown_weight_transfer_engine()

    def alive(self) -> None:
        import requests

        r = requests.get(f"{self.url}/health", timeout=10)
        if r.status_code != 200:
            raise EngineError(f"{self.url}/health answered {r.status_code}: the engine is down")

    def workers(self) -> int:
        import requests

        r = requests.get(f"{self.url}/get_world_size", timeout=30)
        _raise_for(r, self.url, "get_world_size")
        return int(r.json()["world_size"])

    def dtype(self) -> str:
        """The dtype the engine holds its weights in (its ``--dtype``, resolved)."""
        import requests

        r = requests.get(f"{self.url}/server_info", params={"config_format": "json"}, timeout=60)
        _raise_for(r, self.url, "server_info")
        return str(r.json()["vllm_config"]["model_config"]["dtype"])

    def pause(self) -> None:
        """Freeze generation (requests in flight wait) until ``resume``."""
        self.http._post("pause?mode=keep")

    def resume(self) -> None:
        self.http._post("resume")


def _raise_for(r, url: str, path: str) -> None:
    if r.status_code == 404:
        raise EngineError(
            f"{url}/{path} is not served: start `vllm serve` with VLLM_SERVER_DEV_MODE=1 (its "
            "weight-transfer routes) and --weight-transfer-config '{\"backend\": \"shardwise\"}'"
        )
    if r.status_code >= 400:
        try:
            body = r.json()
            detail = body.get("error", body) if isinstance(body, dict) else body
            detail = detail.get("message", detail) if isinstance(detail, dict) else detail
        except ValueError:
            detail = r.text
        raise EngineError(f"{url}/{path} answered {r.status_code}: {detail}")


class Watched:
    """A client whose calls raise ``EngineError`` when the engine dies, refuses or takes
    longer than ``timeout`` seconds; ``version`` is the weight version ``finish`` commits."""

    def __init__(self, client, timeout: float):
        self.client, self.timeout = client, timeout
        self.version: str | None = None
        self.local = client.local

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self, pause: bool = True) -> None:
        """Open an update; ``pause``: a server stops generating first (full mode: layers are
        replaced as they arrive). Delta mode keeps it serving: the updates go to the
        engine's copy of the checkpoint, and the model changes only at the finish."""
        if pause:
            self.call("pause")
        self.call("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None, pause: bool = False) -> None:
        """Commit the update (``pause``: a server stops generating for the commit alone), then
        let the server generate again."""
        if pause:
            self.call("pause")
        self.call("finish_weight_update", weight_version or self.version)
        self.call("resume")

    def abort(self, version: int, resume: bool) -> None:
        """End an update that failed on the trainer's side: the engine drops what it got
        (delta mode) or closes its reload with some layers new (full mode; a server then
        stays paused, not to generate from a mix of versions)."""
        self.call("update_weights", {"version": version, "bucket": -1, "nbytes": 0, "entries": [], "abort": True})
        self.call("finish_weight_update", None)
        if resume:
            self.call("resume")

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("shutdown_weight_transfer_engine")

    def workers(self) -> int:
        return self.call("workers")

    def dtype(self) -> str:
        return self.call("dtype")

    def call(self, method: str, *args) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(getattr(self.client, method)(*args))
            except BaseException as e:  # handed to the waiting caller
                future.set_exception(e)

        threading.Thread(target=run, name=f"shardwise-{method}", daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return future.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                pass
            except EngineError:
                raise
            except Exception as e:
                raise EngineError(f"the engine's {method} failed: {_short(e)}") from e
            try:
                self.client.alive()
            except Exception as e:
                raise EngineError(f"the engine died during {method}: {_short(e)}") from e
            if time.monotonic() > deadline:
                raise EngineError(f"the engine's {method} did not answer in {self.timeout:.0f} s")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    detail = text[-1] if text else ""
    return f"{type(e).__name__}: {detail}" if detail else type(e).__name__
