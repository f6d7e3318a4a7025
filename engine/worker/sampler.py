"""Turns one step's logits into one token per sequence.

Order: repetition / presence / frequency penalties on the raw logits, logit_bias (a bias of
-100 bans the token, as OpenAI documents it), logits processors, the min_tokens mask (last, so
no bias can lift it, and dropped for a row it would leave with no token); then, for non-greedy
rows, temperature, top-k, top-p, min-p and a draw. Every stage runs only on the rows that use
it, vectorised over those rows; a batch of plain greedy requests is a single argmax. Logprobs
are read from the raw logits, as OpenAI reports them.

Every value `SamplingParams` admits gives a defined draw: NaN logits count as banned, +inf as
the largest float, top_p keeps at least the most likely token, top_k above the vocabulary is
the vocabulary. A row left with no admissible token at all (a model that returned NaN, a
grammar whose every token the request banned) is reported in its `SampleResult.error`
instead of a token, so the engine ends that request alone.

Callers must `release(seq_id)` every sequence that ends (finished or aborted): the sampler
keeps per-sequence generators (seeded requests) and penalty statistics until then.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.request.sampling_params import BANNED_BIAS, SamplingParams
from engine.request.sequence import Sequence, TokenLogprob

_GOLDEN = 0x9E3779B97F4A7C15  # spreads choice indices over the 64-bit seed space


_FLOAT_MAX = torch.finfo(torch.float32).max
_FLOAT_TINY = torch.finfo(torch.float32).tiny
NO_ADMISSIBLE_TOKEN = "no token is admissible for this request (every logit is banned or not a number)"


@dataclass
class SampleResult:
    token_id: int
    logprob: TokenLogprob | None
    error: str | None = None   # the row could not be sampled; token_id is meaningless then


@dataclass
class DeviceSample:
    """One step's draw on the logits' device, nothing read back yet."""

    token_ids: Tensor                 # [N] long
    admissible: Tensor                # [N] bool: False where no token could be drawn
    logprobs: list[Tensor] | None     # [chosen, top values, top ids] for the rows that ask

    def tensors(self) -> list[Tensor]:
        return [self.token_ids, self.admissible, *(self.logprobs or [])]


@dataclass
class RngCheckpoint:
    """The random state a draw consumes (the shared CPU stream, each seeded row's generator),
    so a step that is sampled again after a failure draws exactly what it would have."""

    shared: Tensor
    seeded: dict[int, Tensor]


class _PenaltyState:
    """A sequence's token statistics, kept sparse (distinct ids, not a vocab-sized row) and
    updated with only the tokens added since the previous step."""

    def __init__(self, seq: Sequence, width: int) -> None:
        self.width = width
        self.seen = dict.fromkeys(t for t in seq.token_ids[:seq.num_prompt_tokens] if t < width)
        self.counts: dict[int, int] = {}  # output tokens only
        self.num_counted = 0
        self._seen_ids: Tensor | None = None  # cached: rebuilt only when a new id shows up

    def update(self, seq: Sequence) -> None:
        new = seq.token_ids[seq.num_prompt_tokens + self.num_counted:]
        self.num_counted += len(new)
        for t in new:
            if t < self.width:
                self.counts[t] = self.counts.get(t, 0) + 1
                if t not in self.seen:
                    self.seen[t] = None
                    self._seen_ids = None

    def seen_ids(self) -> Tensor:
        if self._seen_ids is None:
            self._seen_ids = torch.tensor(list(self.seen), dtype=torch.long)
        return self._seen_ids


class Sampler:
    def __init__(self, eos_token_ids: set[int], vocab_size: int) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self._generators: dict[int, torch.Generator] = {}
        self._penalties: dict[int, _PenaltyState] = {}

    def release(self, seq_id: int) -> None:
        """Forget a finished or aborted sequence's generator and penalty statistics."""
        self._generators.pop(seq_id, None)
        self._penalties.pop(seq_id, None)

    def __call__(self, logits: Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        """Row i of `logits` [N, V] (float32) belongs to seqs[i]; returns one result per row."""
        draw = self.sample_on_device(logits, seqs)
        return self.results([t.tolist() for t in draw.tensors()], seqs)

    @torch.inference_mode()   # the logits come from an inference-mode forward and are updated in place
    def sample_on_device(self, logits: Tensor, seqs: list[Sequence]) -> DeviceSample:
        """The draw, on the logits' device, nothing read back: `results` turns the host copies of
        its `tensors()` into SampleResults. NaN in `logits` become -inf and +inf the largest float,
        in place."""
        token_ids, admissible = self._draw(logits, seqs)
        logprobs = self._logprob_tensors(logits[:, :self.vocab_size], token_ids, [s.params for s in seqs])
        return DeviceSample(token_ids, admissible, logprobs)

    def results(self, host: list[list], seqs: list[Sequence]) -> list[SampleResult]:
        """SampleResults from the host lists of a `DeviceSample.tensors()`."""
        token_ids, admissible, *logprobs = host
        params = [s.params for s in seqs]
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        found: dict[int, TokenLogprob] = {}
        if logprobs:
            chosen, top_v, top_i = logprobs
            for j, i in enumerate(rows):
                n = params[i].logprobs
                found[i] = TokenLogprob(token_ids[i], chosen[j], list(zip(top_i[j][:n], top_v[j][:n], strict=True)))
        return [SampleResult(t, found.get(i)) if ok else SampleResult(t, None, NO_ADMISSIBLE_TOKEN)
                for i, (t, ok) in enumerate(zip(token_ids, admissible, strict=True))]

    def checkpoint(self, seqs: list[Sequence]) -> RngCheckpoint:
        seeded = {s.seq_id: self._generator(s, s.params.seed).get_state() for s in seqs if s.params.seed is not None}
        return RngCheckpoint(torch.get_rng_state(), seeded)

    def restore(self, checkpoint: RngCheckpoint) -> None:
        torch.set_rng_state(checkpoint.shared)
        for seq_id, state in checkpoint.seeded.items():
            generator = self._generators.get(seq_id)
            if generator is not None:
                generator.set_state(state)

    def token_logprobs(self, logits: Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
        """Logprob of token_ids[i] under row i of `logits` [N, V] (raw, as sampled tokens report
        theirs) with the row's top k: prompt tokens scored in the prefill."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        chosen, top_v, top_i = (t.tolist() for t in _logprob_columns(logits[:, :self.vocab_size], ids, k))
        return [TokenLogprob(t, c, list(zip(i, v, strict=True)))
                for t, c, i, v in zip(token_ids, chosen, top_i, top_v, strict=True)]

    @staticmethod
    def needs_history(params: SamplingParams) -> bool:
        """Whether sampling reads the sequence's earlier output (penalties, min_tokens, processors):
        such rows cannot be sampled before the previous token is on the host."""
        return bool(params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty
                    or params.logit_bias or params.logits_processors or params.min_tokens)

    def sample_ids(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """The chosen token ids [N] on the logits' device; reads nothing back from the device."""
        return self._draw(logits, seqs)[0]

    def _draw(self, logits: Tensor, seqs: list[Sequence]) -> tuple[Tensor, Tensor]:
        """(token ids [N], admissible [N]) on the logits' device; reads nothing back."""
        assert logits.dim() == 2 and logits.shape[0] == len(seqs), "one logits row per sequence"
        raw = logits[:, :self.vocab_size]  # the LM head may be padded past the tokenizer's vocab
        params = [s.params for s in seqs]
        x = self.process_logits(raw, seqs)
        # in place (on `logits` itself when nothing processed them): one pass, no copy per step
        x.nan_to_num_(nan=float("-inf"), posinf=_FLOAT_MAX, neginf=float("-inf"))
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not sampled_rows:
            best, token_ids = x.max(dim=-1)
            return token_ids, best > float("-inf")
        admissible = x.amax(dim=-1) > float("-inf")
        # A row with nothing admissible is reported, not drawn from: make it harmless to draw.
        x = x.masked_fill(~admissible.unsqueeze(1), 0.0)
        token_ids = torch.empty(len(seqs), dtype=torch.long, device=x.device)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            token_ids[greedy_rows] = x[greedy_rows].argmax(dim=-1)
        token_ids[sampled_rows] = self._sample(_take(x, sampled_rows), [seqs[i] for i in sampled_rows])
        return token_ids, admissible

    def process_logits(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """Penalties, logit_bias and the min_tokens mask; `logits` itself is never modified
        (it is returned as is when no sequence uses any of them)."""
        params = [s.params for s in seqs]
        x = logits
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            x = self._apply_penalties(x.clone(memory_format=torch.contiguous_format), seqs)
        if any(p.logit_bias for p in params):
            x = self._apply_logit_bias(x if x is not logits else x.clone(), seqs)
        if any(p.logits_processors for p in params):  # e.g. grammar constraints (engine/text/structured.py)
            x = x if x is not logits else x.clone()
            for i, seq in enumerate(seqs):
                for processor in seq.params.logits_processors:
                    x[i] = processor(seq.output_token_ids, x[i])
        banned = self._min_tokens_bans(seqs, x.shape[1])
        if banned:
            rows, cols = zip(*banned, strict=True)
            masked = x.clone()
            masked[list(rows), list(cols)] = float("-inf")
            # min_tokens yields where it would leave no token (e.g. a grammar that allows only EOS)
            left = (masked > float("-inf")).any(dim=-1, keepdim=True)
            x = torch.where(left, masked, x)
        return x

    # -- logit processors (each modifies `x` in place and returns it) --

    def _apply_penalties(self, x: Tensor, seqs: list[Sequence]) -> Tensor:
        width = x.shape[1]
        rep_idx, rep_pen, sub_idx, sub_amount = [], [], [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty:
                continue
            state = self._penalties.get(seq.seq_id)
            if state is None:
                state = self._penalties[seq.seq_id] = _PenaltyState(seq, width)
            state.update(seq)
            if p.repetition_penalty != 1.0:  # HF: every id in prompt + output
                ids = state.seen_ids()
                rep_idx.append(ids + i * width)
                # a penalty below float32's range would divide by zero
                rep_pen.append(torch.full((ids.numel(),), max(p.repetition_penalty, _FLOAT_TINY)))
            if (p.presence_penalty or p.frequency_penalty) and state.counts:  # OpenAI: output only
                sub_idx.append(torch.tensor(list(state.counts), dtype=torch.long) + i * width)
                counts = torch.tensor(list(state.counts.values()), dtype=torch.float32)
                sub_amount.append(counts * p.frequency_penalty + p.presence_penalty)
        flat = x.view(-1)  # ids are distinct within a row, so plain indexed writes are exact
        if rep_idx:  # statistics live on the CPU; the logits may be on the GPU
            idx, pen = torch.cat(rep_idx).to(x.device), torch.cat(rep_pen).to(x.device)
            values = flat[idx]
            flat[idx] = _saturating(values, torch.where(values > 0, values / pen, values * pen))
        if sub_idx:
            idx = torch.cat(sub_idx).to(x.device)
            flat[idx] = flat[idx] - torch.cat(sub_amount).to(x.device)
        return x

    def _apply_logit_bias(self, x: Tensor, seqs: list[Sequence]) -> Tensor:
        rows, cols, values = [], [], []
        ban_rows, ban_cols = [], []
        for i, seq in enumerate(seqs):
            for token_id, bias in seq.params.logit_bias.items():
                token_id = int(token_id)
                if not 0 <= token_id < x.shape[1]:  # the protocol layer rejects these; never index out
                    continue
                if float(bias) <= BANNED_BIAS:
                    ban_rows.append(i)
                    ban_cols.append(token_id)
                else:
                    rows.append(i)
                    cols.append(token_id)
                    values.append(float(bias))
        if rows:
            x[rows, cols] += torch.tensor(values, device=x.device)
        if ban_rows:
            x[ban_rows, ban_cols] = float("-inf")
        return x

    def _min_tokens_bans(self, seqs: list[Sequence], width: int) -> list[tuple[int, int]]:
        banned: list[tuple[int, int]] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | self.eos_token_ids
                banned.extend((i, t) for t in stops if 0 <= t < width)
        return banned

    # -- sampling --

    def _sample(self, x: Tensor, seqs: list[Sequence]) -> Tensor:
        """Draw one token per row of `x` (processed logits, left unmodified)."""
        params = [s.params for s in seqs]
        # Unnormalised probabilities, largest exactly 1: every filter below and the draw work
        # relative to the row's total, so the softmax's normalising pass is never needed.
        dev = x.device
        probs = _finite(_saturating(x, x.div(torch.tensor([[p.temperature] for p in params], device=dev))))
        probs.sub_(probs.amax(dim=-1, keepdim=True)).exp_()
        width = probs.shape[1]
        rows = [i for i, p in enumerate(params) if 0 < p.top_k < width]   # top_k >= the vocabulary: off
        if rows:
            _in_rows(probs, rows, _top_k_, torch.tensor([[params[i].top_k] for i in rows]))  # host: no sync
        rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if rows:
            _in_rows(probs, rows, _top_p_, torch.tensor([[params[i].top_p] for i in rows], device=dev))
        rows = [i for i, p in enumerate(params) if p.min_p > 0.0]
        if rows:  # the most likely token's weight is 1, so min_p is the floor itself
            _in_rows(probs, rows, lambda t, floor: t.masked_fill_(t < floor, 0.0),
                     torch.tensor([[params[i].min_p] for i in rows], device=dev))
        # Inverse-CDF draw with one uniform per row: several times cheaper on CPU than
        # torch.multinomial at vocabulary widths, and a seeded row takes exactly one number
        # from its own generator per step whatever else is in the batch.
        uniform = torch.rand(len(seqs), 1)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None:
                uniform[i] = torch.rand(1, generator=self._generator(seq, seq.params.seed))
        uniform = uniform.to(dev)  # drawn on the CPU so seeded streams are device-independent
        cdf = probs.cumsum_(dim=-1)
        total = cdf[:, -1:]
        # u * total may round up to total, which would land past the last token with any weight
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        out = torch.searchsorted(cdf, target, right=True).squeeze(1)
        return out.clamp_(max=cdf.shape[1] - 1)

    def _generator(self, seq: Sequence, seed: int) -> torch.Generator:
        """The seeded sequence's own stream; `seed` is its request's (`seq.params.seed`)."""
        gen = self._generators.get(seq.seq_id)
        if gen is None:  # kept across preemption: a recomputed sequence continues its stream
            gen = torch.Generator()
            gen.manual_seed((seed + seq.choice_index * _GOLDEN) % 2**64)
            self._generators[seq.seq_id] = gen
        return gen

    # -- logprobs --

    def _logprob_tensors(self, raw: Tensor, token_ids: Tensor, params: list[SamplingParams]) -> list[Tensor] | None:
        """[chosen [R], top values [R, k], top ids [R, k]] for the R rows that ask for logprobs."""
        wanted = {i: p.logprobs for i, p in enumerate(params) if p.logprobs is not None}
        if not wanted:
            return None
        rows = list(wanted)
        ids = _take(token_ids, rows) if len(rows) == len(params) else token_ids[torch.tensor(rows, device=raw.device)]
        return _logprob_columns(_take(raw, rows), ids, max(wanted.values()))


def _logprob_columns(raw: Tensor, ids: Tensor, k: int) -> list[Tensor]:
    """[chosen [R], top values [R, k], top ids [R, k]]: log-softmax of raw logits rows [R, V] at
    token ids [R], and each row's k most likely tokens."""
    logp = torch.log_softmax(_finite(raw.float()), dim=-1)
    chosen = logp.gather(1, ids.unsqueeze(1)).squeeze(1)
    k = min(k, logp.shape[1])
    top_v, top_i = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
    return [chosen, top_v, top_i]


def _finite(x: Tensor) -> Tensor:
    """NaN as banned (-inf), +inf as the largest float: what reaches a draw is ordered and finite
    or banned. A new tensor; `x` is left alone."""
    return torch.nan_to_num(x, nan=float("-inf"), posinf=_FLOAT_MAX, neginf=float("-inf"))


def _saturating(before: Tensor, after: Tensor) -> Tensor:
    """`after`, an arithmetic result of `before`, clamped to float32's range where it overflowed
    (a very negative logit scaled up is not a ban); `before`'s own infinities are kept."""
    return torch.where(before.isinf(), before, after.clamp(-_FLOAT_MAX, _FLOAT_MAX))


def _take(t: Tensor, rows: list[int]) -> Tensor:
    """t[rows], without the copy when every row is taken (then it is `t` itself)."""
    return t if len(rows) == t.shape[0] else t[rows]


def _in_rows(t: Tensor, rows: list[int], fn: Callable[[Tensor, Tensor], Tensor], arg: Tensor) -> None:
    """Apply the in-place `fn(rows_of_t, arg)` to t[rows]; no copies when every row takes part."""
    if len(rows) == t.shape[0]:
        fn(t, arg)
    else:
        sub = t[rows]
        fn(sub, arg)
        t[rows] = sub


def _top_k_(probs: Tensor, top_k: Tensor) -> Tensor:
    """Zero all but each row's k largest weights (ties with the k-th survive); top_k is [R, 1],
    on the host (its maximum sizes the topk without reading anything back from the device)."""
    k_max = min(int(top_k.max()), probs.shape[1])
    kth = probs.topk(k_max, dim=-1).values.gather(1, top_k.clamp(max=k_max).to(probs.device) - 1)
    return probs.masked_fill_(probs < kth, 0.0)


def _top_p_(probs: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of heaviest tokens whose share of the row's weight reaches top_p
    (at least one; ties with the lightest kept token survive); top_p is [R, 1].

    Sorting a 150k vocabulary is the expensive part of sampling on CPU and a nucleus is usually
    small, so each row looks at a growing number of top candidates until its nucleus fits;
    rows that fit early are not looked at again.
    """
    if probs.is_cuda:
        return _top_p_sorted_(probs, top_p)
    rows, width = probs.shape
    goal = top_p * probs.sum(dim=-1, keepdim=True)
    threshold = torch.empty(rows, 1, device=probs.device)
    pending = torch.arange(rows, device=probs.device)
    k = min(64, width)
    while pending.numel():
        values = _take(probs, pending.tolist()).topk(k, dim=-1).values
        mass = values.cumsum(dim=-1)
        g = goal[pending]
        if k < width:
            done = (mass[:, -1:] >= g).squeeze(1)
        else:
            done = torch.ones(len(pending), dtype=torch.bool, device=probs.device)
        # weight before it is short of goal; at least the heaviest (a top_p below float32's range is 0)
        n_keep = ((mass - values) < g).sum(dim=-1, keepdim=True).clamp_(min=1)
        threshold[pending[done]] = values.gather(1, n_keep - 1)[done]
        pending = pending[~done]
        k = min(k * 8, width)
    return probs.masked_fill_(probs < threshold, 0.0)


def _top_p_sorted_(probs: Tensor, top_p: Tensor) -> Tensor:
    """`_top_p_` by one full sort: no data-dependent loop, so nothing is read back from the device
    and a decode step can stay in flight (engine/core/inflight.py). The GPU sorts a vocabulary fast."""
    values = probs.sort(dim=-1, descending=True).values
    goal = top_p * probs.sum(dim=-1, keepdim=True)
    n_keep = ((values.cumsum(dim=-1) - values) < goal).sum(dim=-1, keepdim=True).clamp_(min=1)
    return probs.masked_fill_(probs < values.gather(1, n_keep - 1), 0.0)
