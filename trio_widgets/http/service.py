"""The Tinker wire's codec over the seam (trio_widgets.backend.Backend): each endpoint decodes its
body into the seam's request types, asks the engine, and encodes what it answers. What a client
observes beyond the wire (sessions, heartbeats and TTL, futures and their retries, seq_id order,
per-key budgets, run and sampler slots) is the engine's served state (trio_widgets/engine/served.py),
which this asks through the seam (`ServedTables`) and keeps no copy of; checkpoints and listings are
each API key's backend's. trio_widgets/http/routes.py decodes requests and calls this; server.py
runs it. What the protocol is: server.py's docstring and docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..backend import (
    Backend,
    CheckpointDir,
    CreateModelRequest,
    ForwardRequest,
    FromStateRequest,
    LoadRequest,
    OptimStepRequest,
    SamplerCreated,
    SampleRequest,
    SaveRequest,
    ServedStateView,
    ServedTables,
)
from ..errors import InvalidInputError
from ..export import DEFAULT_MAX_EXPORT_BYTES
from ..protocol import names
from ..types import SaveWeightsForSamplerResponse, SaveWeightsResponse
from ..validation import check_loss
from . import wire
from .auth import api_key_of, authenticate, owner_of
from .exports import Exports, parse_age_recipients
from .guard import Budget, Pace

T = TypeVar("T")

__all__ = ["Service"]

class Service:
    """The Tinker codec. What it does not decode or encode it asks the engine's served state
    (`self.state`, a `ServedStateView` of the seam's), so both codecs call one table."""

    def __init__(self, pool: Any, *, api_keys: Iterable[str] | None, observer_keys: Iterable[str] | None,
                 models: Iterable[str] | None, long_poll_s: float, max_body_bytes: int,
                 fwdbwd_max_chunk_len: int | None, body_timeout_s: float = 30.0,
                 max_inflight_bytes_per_key: int = 64 << 20, max_inflight_bytes: int = 256 << 20,
                 max_export_bytes: int = DEFAULT_MAX_EXPORT_BYTES, export_url_ttl_s: float = 3600.0,
                 export_timeout_s: float = 3600.0, id_tag: str = "", **served: Any):
        """`served`: the served state's limits (ServedTables' fields: session_timeout_s, reorder_wait_s,
        max_sessions_per_key, ...)."""
        self.pool = pool  # a LocalPool (trio_widgets.connect.Pool): read for its name, clock and telemetry
        self.id_tag = id_tag
        self.backend: Backend = pool.connect(session=False)  # ops and releases (client ids are the pool's)
        self.api_keys = [k for k in (api_keys or ())]
        # a participant's name, where the keys were given with names ({key: name}: a keys file's
        # "KEY Name" lines): a session of that key is labelled by it unless it names itself
        self.key_names = {owner_of(k): str(n).strip()[:40] for k, n in api_keys.items() if str(n).strip()} \
            if isinstance(api_keys, Mapping) else {}
        self.observer_keys = [k for k in (observer_keys or ())]
        self.models = list(dict.fromkeys(models if models is not None else pool.supported_models()))
        self.long_poll_s = float(long_poll_s)
        self.max_body_bytes = int(max_body_bytes)
        self.body_timeout_s = float(body_timeout_s)
        self.budget = Budget(per_key=max(int(max_inflight_bytes_per_key), self.max_body_bytes),
                             total=max(int(max_inflight_bytes), self.max_body_bytes))
        self.fwdbwd_max_chunk_len = int(fwdbwd_max_chunk_len or pool.limits.max_request_data)
        self.pace = Pace()  # one key's catalog work paced, whichever codec asks (guard.py)
        self.streams = 0
        self.streams_of: dict[str, int] = {}  # open telemetry streams per key (or address, without keys)
        tables = ServedTables(tuple(self.models), self.key_names, id_tag=id_tag, **served)
        self.state: ServedStateView = self.backend.call(tables)
        self.exports = Exports(lambda owner, path: self.of(owner).call(CheckpointDir(path)),
                               max_bytes=max_export_bytes, url_ttl_s=export_url_ttl_s, timeout_s=export_timeout_s)

    def authenticate(self, request: Request, observer: bool = False) -> str:
        return authenticate(api_key_of(request.headers), self.api_keys, self.observer_keys, observer)

    def of(self, owner: str) -> Backend:
        """The backend of an API key: its runs, checkpoints and listings."""
        return self.state.of(owner)

    async def catalog(self, owner: str, work: Callable[[], T]) -> T:
        """`work()` (a key's listing, delete, export: disk and JSON) on the catalog's thread, paced per key."""
        return await self.pace.run(owner, lambda: self.state.off_loop(work))

    # -- sessions, models ---------------------------------------------------------------------
    def create_session(self, owner: str, body: dict) -> dict:
        session_id = self.state.create_session(owner, body.get("user_metadata"), body.get("display_name"))
        return {"session_id": session_id, "type": "create_session"}

    def create_model(self, owner: str, body: dict) -> dict:
        session = self.state.session(body.get("session_id"), owner)
        n, model_id, label, first = self.state.run_slot(session, body.get("model_seq_id"), body.get("user_metadata"))
        if first is not None:  # a retry of the same create
            return {"request_id": first.request_id}
        base = self.state.base_model(body.get("base_model"))
        lora = body.get("lora_config") or {}
        if not isinstance(lora, dict):
            raise InvalidInputError("must be an object", field="lora_config")
        optimizer = body.get("optimizer_config") or {"type": "adamw"}
        if not isinstance(optimizer, dict) or optimizer.get("type", "adamw") != "adamw":
            raise InvalidInputError(f"only AdamW is supported here, got {optimizer!r:.80}", field="optimizer_config")
        # rank, seed and the train_* flags are the engine's to check (LocalBackend.create_model), as in-process
        rank, seed = lora.get("rank", 32), lora.get("seed")
        # the key's backend puts the run's checkpoints where its tinker:// paths point
        request = CreateModelRequest(base, rank, seed,
                                     train_mlp=bool(lora.get("train_mlp", True)),
                                     train_attn=bool(lora.get("train_attn", True)),
                                     train_unembed=bool(lora.get("train_unembed", True)), label=label,
                                     user_metadata=_metadata(body.get("user_metadata")), run_id=model_id,
                                     session_id=session.session_id)
        entry = self.state.open_run(owner, session, n, request, label)
        return {"request_id": entry.request_id, "model_id": model_id}

    def load_weights(self, owner: str, body: dict) -> dict:
        optimizer = body.get("optimizer")
        if not isinstance(optimizer, bool):
            raise InvalidInputError(f"must be true or false, got {optimizer!r:.40}", field="optimizer")
        if body.get("weights_access_token"):
            raise InvalidInputError("loading checkpoints of another account is not supported here",
                                    field="weights_access_token")
        if "session_id" not in body:  # the legacy form: load into an existing model, in its order
            model = self.state.model(body.get("model_id"), owner)
            with self.state.consumes(model, body.get("seq_id")):
                self.of(owner).call(CheckpointDir(body.get("path")))  # refused now if it is not this key's
            op = "load_state_with_optimizer" if optimizer else "load_state"
            path = body["path"]
            return self.state.sequenced(model, owner, body.get("seq_id"), op, LoadRequest(path),
                                   lambda _r: ({"path": path, "model_id": model.model_id, "type": "load_weights"},
                                               False))
        session = self.state.session(body.get("session_id"), owner)
        n, model_id, label, first = self.state.run_slot(session, body.get("model_seq_id"), body.get("user_metadata"))
        if first is not None:
            return {"request_id": first.request_id}
        self.of(owner).call(CheckpointDir(body.get("path")))  # refused now if it is not this key's
        base = body.get("base_model")  # compared with the checkpoint's by the engine, as in-process
        request = FromStateRequest(body["path"], optimizer, label, base_model=base if isinstance(base, str) else None,
                                   user_metadata=_metadata(body.get("user_metadata")), run_id=model_id,
                                   session_id=session.session_id)
        entry = self.state.open_run(owner, session, n, request, label, kind="load_weights",
                              then=lambda _out: {"path": body["path"], "model_id": model_id, "type": "load_weights"})
        return {"request_id": entry.request_id, "model_id": model_id}

    def get_info(self, owner: str, body: dict, local: bool = True) -> dict:
        model = self.state.model(body.get("model_id"), owner)
        h = model.handle
        return {"type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": h.rank,
                "model_name": h.base_model,
                "model_data": {"arch": "llama", "model_name": h.base_model,
                               "tokenizer_id": self.state.tokenizer_id(h.base_model, local)},
                # trio's client reads these (the tinker SDK ignores extra fields)
                "trio": {"alpha": h.alpha, "seed": h.seed, "train_attn": h.train_attn, "train_mlp": h.train_mlp,
                         "train_unembed": h.train_unembed, "label": model.label}}

    # -- requests of a model, in seq_id order (the engine's sequencer) -------------------------
    def forward_backward(self, owner: str, body: bytes) -> dict:
        model_id, seq, data, loss_fn, config, forward_only = wire.decode_forward_request(
            body, self.pool.limits.max_request_tokens)
        model = self.state.model(model_id, owner)
        # a trio client marks the second half of a custom loss so the dashboard names it
        op = "forward" if forward_only else ("forward_backward_custom" if config.pop("trio_op", None) ==
                                             "forward_backward_custom" else "forward_backward")
        with self.state.consumes(model, seq):
            if loss_fn == "custom":
                raise InvalidInputError("server-side custom losses are not supported here: call "
                                        "forward_backward_custom (the two-step exchange), which needs nothing "
                                        "from the server", field="loss_fn")
            loss_fn, config = check_loss(loss_fn, config or None)
        return self.state.sequenced(model, owner, seq or None, op, ForwardRequest(data, loss_fn, config),
                               lambda out: (wire.encode_forward_output(out), True))

    def optim_step(self, owner: str, body: dict) -> dict:
        model = self.state.model(body.get("model_id"), owner)
        with self.state.consumes(model, body.get("seq_id")):
            if "optimizer_params" in body:
                raise InvalidInputError("only AdamW (adam_params) is supported here", field="optimizer_params")
            params = wire.adam_from_json(body.get("adam_params", body.get("optim_params")))
        return self.state.sequenced(model, owner, body.get("seq_id"), "optim_step", OptimStepRequest(params),
                               lambda r: ({"metrics": wire.tinker_metric_keys(r.metrics)}, False))

    def save_weights(self, owner: str, body: dict) -> dict:
        model = self.state.model(body.get("model_id"), owner)
        with self.state.consumes(model, body.get("seq_id")):
            name = names.validate_name(body.get("path"), "name")
            overwrite = body.get("overwrite", False)
            if not isinstance(overwrite, bool):
                raise InvalidInputError(f"must be true or false, got {overwrite!r:.40}", field="overwrite")

        def encode(result: SaveWeightsResponse) -> tuple[dict, bool]:
            # the engine's path and fields, as in-process (model, size: pytrio's; the tinker SDK ignores them)
            return {"path": result.path, "type": "save_weights", "model": result.model, "size": result.size}, False

        # overwrite, TTL and metadata are the engine's to check and enforce, as in-process
        request = SaveRequest(name, overwrite=overwrite, ttl_seconds=body.get("ttl_seconds"),
                              user_metadata=body.get("user_metadata"))
        return self.state.sequenced(model, owner, body.get("seq_id"), "save_state", request, encode)

    def save_weights_external(self, owner: str, body: dict) -> dict:
        """tinker's export: the weights as a PEFT directory under external_weights/, fetched with
        the signed URLs of get_external_weights_urls (trio_widgets/http/exports.py)."""
        model = self.state.model(body.get("model_id"), owner)
        with self.state.consumes(model, body.get("seq_id")):
            name = names.validate_name(body.get("path"), "name")
            recipients = parse_age_recipients(body.get("age_encryption_recipients"))
        path = names.checkpoint_path(model.model_id, "external_weights", name)
        request = SaveRequest(name, ttl_seconds=body.get("ttl_seconds"), external=True, age_recipients=recipients)
        return self.state.sequenced(model, owner, body.get("seq_id"), "save_weights_for_sampler", request,
                               lambda _r: ({"path": path, "type": "save_weights_external"}, False))

    def save_weights_for_sampler(self, owner: str, body: dict) -> dict:
        model = self.state.model(body.get("model_id"), owner)
        name, n, session = body.get("path"), body.get("sampling_session_seq_id"), model.session

        def encode(result: Any) -> tuple[dict, bool]:
            out: dict[str, Any] = {"type": "save_weights_for_sampler"}
            if path is not None:
                out["path"] = path
            if isinstance(result, SaveWeightsForSamplerResponse):
                out.update(model=result.model, size=result.size)
            if isinstance(result, SamplerCreated):
                assert n is not None and sampler_id is not None  # only a request with sampling_session_seq_id
                self.state.register_sampler(session, sampler_id, result.sampler, path, n)
                out["sampling_session_id"] = sampler_id
            return out, False

        with self.state.consumes(model, body.get("seq_id")):  # (a refusal, even the engine's, uses up its seq_id)
            if body.get("kind", "snapshot") != "snapshot":
                raise InvalidInputError(f"only 'snapshot' sampling clients are supported here (a copy of the "
                                        f"weights as of this request), got {body.get('kind')!r:.40}", field="kind")
            if name is None and n is None:
                raise InvalidInputError("give a name (path) or sampling_session_seq_id", field="name")
            if name is not None:
                names.validate_name(name, "name")
            if n is not None:
                self.state.sampler_slot(session, n)
            path = names.checkpoint_path(model.model_id, "sampler_weights", name) if name is not None else None
            sampler_id = names.sampler_id(session.session_id, n) if n is not None else None
            request = SaveRequest(name, make_sampler=n is not None, label=names.sampler_id(session.label, n)
                                  if n is not None else None, ttl_seconds=body.get("ttl_seconds"),
                                  user_metadata=body.get("user_metadata"), sampler_id=sampler_id)
            return self.state.sequenced(model, owner, body.get("seq_id"), "save_weights_for_sampler", request, encode)

    # -- sampling ----------------------------------------------------------------------------
    async def create_sampling_session(self, owner: str, body: dict) -> dict:
        session = self.state.session(body.get("session_id"), owner)
        sampler_id = await self.state.open_sampler(owner, session, body.get("sampling_session_seq_id"),
                                                   body.get("model_path"), body.get("base_model"))
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def get_sampler(self, owner: str, sampler_id: str, local: bool = True) -> dict:
        sampler = self.state.sampler(sampler_id, owner)
        h = sampler.handle
        out: dict[str, Any] = {"sampler_id": sampler_id, "base_model": h.base_model,
                               "trio": {"rank": h.rank, "alpha": h.alpha, "seed": h.seed,
                                        "tokenizer_id": self.state.tokenizer_id(h.base_model, local)}}
        if sampler.model_path is not None:
            out["model_path"] = sampler.model_path
        return out

    def asample(self, owner: str, body: dict) -> dict:
        if body.get("sampling_session_id") is None:
            raise InvalidInputError("sample through a sampling session (create_sampling_client); sampling by "
                                    "model_path or base_model per request is not supported here",
                                    field="sampling_session_id")
        sampler = self.state.sampler(body.get("sampling_session_id"), owner)
        if body.get("record_stability_info") not in (False, None):
            raise InvalidInputError("is not supported by the local pool; leave it at False",
                                    field="record_stability_info")
        caller = body.get("session_id") if isinstance(body.get("session_id"), str) else None

        def request() -> SampleRequest:  # decoded unless a retry (the engine deduplicates by caller and seq_id)
            target = body.get("target_prompt_logprobs")
            # the options are the engine's to check, as in-process (the same errors, naming the same fields)
            return SampleRequest(wire.model_input_from_json(body.get("prompt")), body.get("num_samples", 1),
                                 wire.sampling_params_from_json(body.get("sampling_params") or {}),
                                 bool(body.get("prompt_logprobs")),
                                 topk_prompt_logprobs=body.get("topk_prompt_logprobs") or 0,
                                 topk_sample_logprobs=body.get("topk_sample_logprobs") or 0,
                                 prompt_logprobs_last_n=body.get("prompt_logprobs_last_n"),
                                 target_prompt_logprobs=None if target is None else
                                 wire.tensor_from_json(target, "target_prompt_logprobs", 1 << 22, pad=-1),
                                 prompt_alt_tokens_k=body.get("prompt_alt_tokens_k") or 0)

        request_id, ids = self.state.sample_once(owner, sampler, caller, body.get("seq_id"), request,
                                                 lambda r: (wire.encode_sample_response(r), True))
        return {"request_id": request_id, "sample_sequence_ids": ids}

    def release(self, owner: str, body: dict) -> dict:
        """trio's client closed a training or sampling client: retire it once its queue is empty."""
        self.state.release(owner, body.get("id"))
        return {"released": body.get("id")}

    # -- futures -------------------------------------------------------------------------------
    async def retrieve(self, owner: str, body: dict) -> Response:
        request_id = body.get("request_id")
        entry = self.state.entry(request_id, owner)
        if not await self.state.wait(entry, self.long_poll_s):
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        headers = {"X-Trio-Cycle": str(entry.cycle)} if entry.cycle is not None else {}
        if entry.error is not None:
            return JSONResponse(entry.error.future_body(), headers=headers)
        if entry.protobuf:
            assert isinstance(entry.body, bytes)
            return Response(entry.body, media_type=wire.PROTOBUF, headers=headers)
        return JSONResponse(entry.body, headers=headers)

    def cancel(self, owner: str, body: dict) -> dict:
        request_id = body.get("request_id")
        return {"request_id": request_id, "cancelled": self.state.cancel(request_id, owner)}

    def export_urls(self, owner: str, tinker_path: Any, base_url: str) -> dict:
        return self.exports.urls(owner, tinker_path, base_url)


def _metadata(value: Any) -> dict[str, str] | None:
    """A model's user_metadata as the engine keeps it (strings only; anything else is dropped:
    the SDK sends what the user gave, and a label is no reason to refuse a model)."""
    if not isinstance(value, dict):
        return None
    return {str(k)[:200]: str(v)[:1000] for k, v in list(value.items())[:64]}
