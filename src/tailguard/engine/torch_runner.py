"""All tensor work of a step: build the flat batch and its attention metadata, run the model, sample."""

from __future__ import annotations

import torch

from tailguard.engine.blocks import BlockTable
from tailguard.engine.internals import StepProbe
from tailguard.engine.kv_layout import NATIVE_PREFILL_MAX_CONTEXT, touch_kv_blocks
from tailguard.engine.sampling import SampledToken, banned_tokens, failed_row
from tailguard.engine.scheduler import ScheduledChunk, leading_decode_rows
from tailguard.engine.sequence import SamplingParams, Sequence
from tailguard.engine.torch_model import AttentionMetadata, LlamaModel, PrefillSpan


class ModelRunner:
    # Prefill chunks ending within this many positions run as rows of the C step (model.NATIVE_PREFILL_MAX_CONTEXT).
    native_prefill_max_context: int = NATIVE_PREFILL_MAX_CONTEXT

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None,
                 kv_cache: torch.Tensor | None = None) -> None:
        """``kv_cache``: run over an existing cache instead of allocating one (the self-draft reads the target's)."""
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kv_cache = kv_cache if kv_cache is not None else model.allocate_kv_cache(num_blocks, block_size, kv_dtype)
        self._generators: dict[str, torch.Generator] = {}

    def touch_kv_blocks(self, first: int, end: int) -> None:
        """Make never-used blocks [first, end) of a CPU KV cache resident (engine.warm_kv); a GPU's is already."""
        if self.kv_cache.device.type == "cpu":
            touch_kv_blocks(self.kv_cache, first, end)

    # --- batch building -------------------------------------------------------------------------------------------
    def _build(self, chunks: list[ScheduledChunk], tables: dict[str, BlockTable], in_torch: bool = False):
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        dev = self.device
        bs = self.block_size
        # With the one-call C step every token is a row of its own, prefill chunks included, while every prefill
        # chunk ends within native_prefill_max_context positions (beyond, torch's attention is faster): see forward.
        native = self.model.uses_decode_kernel and not in_torch and all(
            c.is_decode or c.draft or c.end <= self.native_prefill_max_context for c in chunks)
        for chunk in chunks:
            table = tables[chunk.seq.request_id]
            start_tok = len(ids)
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(table.slot(p) for p in range(chunk.start, chunk.end))
            if chunk.draft:  # verification: every position yields the target's token there
                logits_indices.extend(range(len(ids) - 1 - len(chunk.draft), len(ids)))
            elif chunk.samples:
                logits_indices.append(len(ids) - 1)
            used_blocks = table.blocks[: -(-chunk.end // bs)]
            if chunk.is_decode or chunk.draft or native:
                # A verifying chunk is K+1 decode rows over one block table, row i attending to its own position and
                # those before it: every row's K/V is written before attention runs (in C and in torch), so this is
                # exact causal attention, and a verification step stays in the one-call C decode step. In the C step
                # a prefill chunk is rows the same way.
                for position in range(chunk.start, chunk.end):
                    decode_tables.append(used_blocks)
                    decode_lens.append(position + 1)
            elif chunk.start == 0:
                prefills.append(PrefillSpan(start_tok, len(ids), None, None))
            else:
                gather = torch.tensor(used_blocks, dtype=torch.long, device=dev)
                q_pos = torch.arange(chunk.start, chunk.end, device=dev).unsqueeze(1)
                mask = torch.arange(len(used_blocks) * bs, device=dev).unsqueeze(0) <= q_pos
                prefills.append(PrefillSpan(start_tok, len(ids), gather, mask))
        decode_gather = decode_mask = lengths = None
        if decode_tables:
            decode_gather, decode_mask, lengths = self._decode_tables(
                decode_tables, decode_lens, native)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            num_decodes=len(decode_tables),
            decode_gather=decode_gather,
            decode_mask=decode_mask,
            prefills=prefills,
            decode_lens=lengths,
            num_decode_rows=leading_decode_rows(chunks) if native else None,
        )
        return torch.tensor(ids, dtype=torch.long, device=dev), meta, torch.tensor(logits_indices, dtype=torch.long, device=dev)

    def _decode_tables(self, tables: list[list[int]], lens: list[int], native: bool):
        """Padded block tables, the key mask (torch path only) and lengths of decode rows."""
        widest = max(len(t) for t in tables)
        # The native kernel reads int32 block tables and needs no mask.
        gather = torch.tensor([t + [0] * (widest - len(t)) for t in tables],
                              dtype=torch.int32 if native else torch.long).to(self.device)
        lengths = torch.tensor(lens, dtype=torch.int32)
        mask = None
        if not native:
            mask = (torch.arange(widest * self.block_size).unsqueeze(0) < lengths.unsqueeze(1)).view(
                len(lens), 1, 1, -1).to(self.device)
        return gather, mask, lengths

    def decode_rows(self, token_ids: list[int], positions: list[int], tables: list[BlockTable]) -> torch.Tensor:
        """Logits of one-token rows at the given positions, each over its own block table (blocks already held): a
        draft model's guesses, fed one position at a time."""
        dev = self.device
        used = [t.blocks[: p // self.block_size + 1] for t, p in zip(tables, positions)]
        gather, mask, lengths = self._decode_tables(used, [p + 1 for p in positions], self.model.uses_decode_kernel)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([t.slot(p) for t, p in zip(tables, positions)], dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            num_decodes=len(positions), decode_gather=gather, decode_mask=mask, prefills=[], decode_lens=lengths)
        rows = torch.arange(len(positions), dtype=torch.long, device=dev)
        return self.model.forward(torch.tensor(token_ids, dtype=torch.long, device=dev), meta, self.kv_cache, rows)

    def chunk_logits(self, chunks: list[ScheduledChunk], tables: dict[str, BlockTable],
                     probe: StepProbe | None = None) -> torch.Tensor:
        """Run chunks (prefills and decodes) and return the logits of each sampling chunk's last position. ``probe``:
        the step is instrumented (sampled internals) and runs in torch."""
        input_ids, meta, logits_indices = self._build(chunks, tables, in_torch=probe is not None)
        return self.model.forward(input_ids, meta, self.kv_cache, logits_indices, probe)

    # --- the step -------------------------------------------------------------------------------------------------
    def execute(self, chunks: list[ScheduledChunk], tables: dict[str, BlockTable],
                stop_ids: set[int], probe: StepProbe | None = None) -> list[list[SampledToken]]:
        """Run one step; returns each chunk's new tokens: none for a prefill chunk that does not reach the end of its
        prompt, one for a decode or a last prefill chunk, one to K+1 for a chunk verifying K guesses. ``probe``: the
        step is instrumented (sampled internals) and runs in torch."""
        if not chunks:
            return []
        logits = self.chunk_logits(chunks, tables, probe)
        plain_rows: list[int] = []
        row = 0
        for c in chunks:
            if c.draft:
                row += len(c.draft) + 1
            elif c.samples:
                plain_rows.append(row)
                row += 1
        plain_seqs = [c.seq for c in chunks if c.samples and not c.draft]
        if len(plain_rows) < row:  # some rows verify guesses: the plain sampler sees only its own rows
            plain_logits = logits.index_select(0, torch.tensor(plain_rows, dtype=torch.long, device=logits.device))
        else:
            plain_logits = logits
        plain = iter(self.sample(plain_logits, plain_seqs, stop_ids))
        results: list[list[SampledToken]] = []
        row = 0
        for c in chunks:
            if c.draft:
                width = len(c.draft) + 1
                try:
                    results.append(self.verify(logits[row : row + width], c.seq, c.draft))
                except Exception as exc:  # noqa: BLE001 - this request's failure alone
                    results.append([failed_row(exc)])
                row += width
            elif c.samples:
                results.append([next(plain)])
                row += 1
            else:
                results.append([])
        return results

    def verify(self, logits: torch.Tensor, seq: Sequence, draft: list[int]) -> list[SampledToken]:
        """The target's tokens for a chunk that guessed ``draft``: the accepted guesses, then one token of its own.

        ``logits`` has a row per position: row i scores the token after the pending token and the first i guesses.
        Greedy: guesses are accepted while they equal the argmax, and the first mismatch is replaced by the argmax,
        so the output is exactly the non-speculative one. Sampling (a deterministic proposer puts all its mass on its
        guess x): accept x with probability p(x); on a rejection draw from p with x removed and renormalized. Each
        token is then distributed as p, with p the same transformed distribution (temperature, top-k, top-p) the
        plain sampler draws from. The scheduler proposes nothing while min_tokens bans stop tokens.
        """
        sp = seq.sampling
        picks: list[int] = []
        if sp.greedy:
            target = logits.argmax(dim=-1).tolist()
            for i, guess in enumerate(draft):
                picks.append(target[i])
                if target[i] != guess:
                    break
            else:
                picks.append(target[len(draft)])
        else:
            gen = self._generator(seq)
            for i, guess in enumerate(draft):
                probs = self._probs(logits[i], sp)
                u = torch.rand(1, generator=gen, device=probs.device).item()
                if u < float(probs[guess]):
                    picks.append(guess)
                    continue
                probs[guess] = 0.0
                picks.append(int(torch.multinomial(probs, 1, generator=gen).item()))
                break
            else:
                probs = self._probs(logits[len(draft)], sp)
                picks.append(int(torch.multinomial(probs, 1, generator=gen).item()))
        if sp.logprobs is None:
            return [SampledToken(t) for t in picks]
        logprobs = torch.log_softmax(logits[: len(picks)], dim=-1)
        out = []
        for i, tok in enumerate(picks):
            top = torch.topk(logprobs[i], sp.logprobs) if sp.logprobs else None
            top_list = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            out.append(SampledToken(tok, float(logprobs[i, tok]), top_list))
        return out

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], stop_ids: set[int]) -> list[SampledToken]:
        results: list[SampledToken] = []
        failed: dict[int, Exception] = {}
        chosen = self._transformed(logits, seqs, stop_ids, failed)
        greedy_rows = [i for i, s in enumerate(seqs) if s.sampling.greedy and i not in failed]
        picks: dict[int, int] = {}
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            masked = self._mask_early_stop(chosen[idx], [seqs[i] for i in greedy_rows], stop_ids)
            for row, tok in zip(greedy_rows, masked.argmax(dim=-1).tolist()):
                picks[row] = tok
        for row, seq in enumerate(seqs):
            try:
                if row in failed:
                    raise failed[row]
                if row not in picks:
                    picks[row] = self._sample_one(chosen[row : row + 1], seq, stop_ids)
                # logprobs are always of the raw logits (vLLM's default), as in the numpy sampler
                results.append(self._with_logprobs(logits[row], picks[row], seq.sampling.logprobs))
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end its step's neighbours
                results.append(failed_row(exc))
        return results

    @staticmethod
    def _transformed(logits: torch.Tensor, seqs: list[Sequence], stop_ids: set[int],
                     failed: dict[int, Exception]) -> torch.Tensor:
        """The logits tokens are chosen from: ``logits`` itself unless a request has penalties, a logit bias or a
        grammar, whose rows are then replaced (in a copy) by their LogitsState's transform, min_tokens ban included:
        the numpy sampler's code, so both runners choose alike. A row whose transform fails is put in ``failed``."""
        rows = [i for i, s in enumerate(seqs) if s.logits_state is not None]
        if not rows:
            return logits
        out = logits.clone()
        for i in rows:
            seq = seqs[i]
            state = seq.logits_state
            assert state is not None
            try:
                row = state.process(logits[i].detach().float().cpu().numpy(), seq, banned_tokens(seq, stop_ids))
                out[i] = torch.from_numpy(row).to(device=out.device, dtype=out.dtype)
            except Exception as exc:  # noqa: BLE001 - this request alone
                failed[i] = exc
        return out

    @staticmethod
    def _with_logprobs(row: torch.Tensor, tok: int, n_top: int | None) -> SampledToken:
        if n_top is None:
            return SampledToken(tok)
        logprobs = torch.log_softmax(row, dim=-1)
        top = torch.topk(logprobs, n_top) if n_top else None
        top_list = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        return SampledToken(tok, float(logprobs[tok]), top_list)

    @staticmethod
    def _mask_early_stop(logits: torch.Tensor, seqs: list[Sequence], stop_ids: set[int]) -> torch.Tensor:
        """Forbid stop tokens while a request is below its min_tokens (rows with a LogitsState have had it applied)."""
        rows = [i for i, s in enumerate(seqs)
                if len(s.output_token_ids) < s.sampling.min_tokens and s.logits_state is None]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:  # each row its own request's stop tokens
            logits[i, list(stop_ids | set(seqs[i].sampling.stop_token_ids))] = float("-inf")
        return logits

    def _sample_one(self, logits: torch.Tensor, seq: Sequence, stop_ids: set[int]) -> int:
        probs = self._probs(self._mask_early_stop(logits, [seq], stop_ids)[0], seq.sampling)
        return int(torch.multinomial(probs, 1, generator=self._generator(seq)).item())

    @staticmethod
    def _probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
        """The distribution a sampled token is drawn from: temperature, then top-k, then top-p (a new tensor that sums
        to one)."""
        row = logits / sp.temperature
        if sp.top_k:
            kth = torch.topk(row, min(sp.top_k, row.shape[-1])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if sp.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            drop = cumulative - sorted_probs >= sp.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs /= probs.sum()  # verification compares a uniform draw with p(guess): p must sum to one
        return probs

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        """A seeded request's own random stream (None: torch's global one)."""
        gen = self._generators.get(seq.request_id)
        if gen is None and seq.sampling.seed is not None:
            gen = torch.Generator(device=self.device)
            seed = seq.sampling.generator_seed
            assert seed is not None  # set whenever sampling.seed is
            gen.manual_seed(seed)
            self._generators[seq.request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
