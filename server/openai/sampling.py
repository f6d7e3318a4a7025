"""Request fields → `SamplingParams`, with every error a 400 that names the field."""
from __future__ import annotations

from typing import Any

from engine.request.sampling_params import SamplingParams, SamplingParamsError
from server.core.engine_client import EngineClient
from server.core.errors import APIError, bad_request, context_length_error
from server.openai.protocol import _SamplingFields


def max_tokens_for(requested: int | None, param: str, num_prompt_tokens: int, max_context_len: int,
                   max_new_tokens: int, default: int | None, allow_zero: bool = False, zero_hint: str = "") -> int:
    """The output budget: the request's value (or `default`, or the room left), capped by
    model.max_new_tokens and the context room. Too large a value is clamped, as vLLM does,
    which suits agents that always send a big max_tokens; a prompt that leaves no room is a 400.
    `allow_zero`: 0 is a budget (the prompt is only scored); `zero_hint` tells an error when 0 is allowed."""
    room = max_context_len - num_prompt_tokens
    if room < 1:
        raise context_length_error(max_context_len, num_prompt_tokens)
    if requested == 0 and allow_zero:
        return 0
    if requested is not None and requested < 1:
        when = f" (0 {zero_hint})" if zero_hint else ""
        raise bad_request(f"{param} must be at least 1{when}, got {requested}", param)
    wanted = requested if requested is not None else (default if default is not None else room)
    return max(1, min(wanted, max_new_tokens, room))


def _token_ids(values: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, bias in (values or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1})",
                              "logit_bias")
        out[token_id] = float(bias)
    return out


def build_params(req: _SamplingFields, *, engine: EngineClient, max_tokens: int, logprobs: int | None,
                 extra: dict[str, Any] | None = None, rename: dict[str, str] | None = None) -> SamplingParams:
    """`rename` maps SamplingParams' field names to this route's request fields in errors."""
    vocab_size = engine.tokenizer.vocab_size
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    for token_id in req.stop_token_ids or []:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"stop_token_ids: {token_id} is outside the vocabulary", "stop_token_ids")
    fields: dict[str, Any] = dict(
        n=1 if req.n is None else req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or 0,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        logit_bias=_token_ids(req.logit_bias, vocab_size),
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
    )
    fields.update(extra or {})
    try:
        return SamplingParams(**fields)
    except SamplingParamsError as exc:
        raise bad_request(str(exc), (rename or {}).get(exc.param, exc.param)) from None
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"invalid sampling parameters: {exc}") from None
