"""
speculative.py: speculative decoding's proposers. Importing it registers its methods, "ngram"
and "draft", in nanopaged.SPECULATIVE_METHODS, where Engine(speculative_config={"method": name,
...}) finds them; demo.py and server.py import it, and so does a script that speculates.

    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative Decoding",
    ICML 2023.  Chen et al., "Accelerating Large Language Model Decoding with Speculative
    Sampling", 2023.  Saxena, "Prompt Lookup Decoding", 2023 (the n-gram proposer).

Decoding makes one token per sequence per step, and a small step costs about what its fixed
overheads cost, not its arithmetic. So each step checks a few guessed tokens as well: a
proposer guesses up to k tokens after each decoding sequence, the target model runs the
sequence's next token and the k guesses as one chunk of the packed batch (a chunk of k + 1
new tokens, as chunked prefill already runs), and the guesses its own draws agree with are
kept: up to k + 1 tokens for one step of the target.

The rest is paging, and lives in nanopaged.py: the scheduler reserves lookahead slots for the
guesses from what plain scheduling left (Scheduler._reserve_lookahead), the verification
writes their K/V there, and the blocks past the kept tokens go back to the pool
(BlockAllocator.trim). A guess's block enters the prefix cache only once the guess is kept:
the next step's plan publishes it with the sequence's other computed blocks.

The engine calls a proposer three times a step: propose() in the step's run, before the
forward; verify() in the run, on the target's draws (the rule below); count() in the commit.

Acceptance (Proposer.verify) is rejection sampling. Leviathan et al. accept a
guess d with probability min(1, p(d) / q(d)), p the target's distribution and q the
proposer's, and on a rejection draw from max(0, p - q), renormalised; the tokens that come out
are distributed as p exactly. Both proposers here guess deterministically (q is all on d), and
then the rule is: keep d with probability p(d), else draw from p without d. Drawing x from p
and keeping d iff x == d (x is the token then) does exactly that, so the engine draws each
token as it would without speculation, with the same seeded generator, and keeps going while
the draws equal the guesses. (vLLM's rejection sampler treats its n-gram and greedy draft
guesses as such one-point q too.) The output is then the target's alone, token for token:
greedy or seeded, with or without speculation, and whatever the batch-mates.
"""

import math

import nanopaged
from nanopaged import GPT, Chunk, ModelRunner, as_int, integer, kv_block_shape, step_chunks, tp


def check_config(config, settings):
    """What every method's speculative_config shares: its keys are "method",
    "num_speculative_tokens" and the method's settings; num_speculative_tokens is an int >= 1;
    no tensor parallelism. Returns num_speculative_tokens, or raises a ValueError naming what
    is wrong. A fork's method calls it too."""
    allowed = {"method", "num_speculative_tokens", *settings}
    unknown = set(config) - allowed
    if unknown:
        raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} for method "
                         f"{config['method']!r} (it takes {sorted(allowed)})")
    k = as_int(config.get("num_speculative_tokens"))
    if not (integer(k) and k >= 1):
        raise ValueError(f"speculative_config: num_speculative_tokens must be an int >= 1, "
                         f"got {k!r}")
    if tp.world_size > 1:
        raise ValueError("speculative_config: speculative decoding under tensor parallelism is "
                         "not supported")
    return k


def ngram(config, model, device):
    """{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
    "prompt_lookup_min": m}: prompt lookup, any model."""
    k = check_config(config, ("prompt_lookup_max", "prompt_lookup_min"))
    n = as_int(config.get("prompt_lookup_max", 4))
    m = as_int(config.get("prompt_lookup_min", 2))
    if not (integer(n) and integer(m) and 1 <= m <= n):
        raise ValueError(f"speculative_config: need ints prompt_lookup_max >= "
                         f"prompt_lookup_min >= 1, got {n!r} and {m!r}")
    return NgramProposer(k, n, m)


def draft(config, model, device):
    """{"method": "draft", "model": a GPT, "num_speculative_tokens": k}: the draft with the
    target's vocabulary, attention kind and context length."""
    k = check_config(config, ("model",))
    draft_model, target = config.get("model"), model.config
    if not isinstance(draft_model, GPT):
        raise ValueError(f"speculative_config: 'model' must be a GPT (the draft), "
                         f"got {type(draft_model).__name__}")
    if draft_model.config.vocab_size != target.vocab_size:  # the same token ids
        raise ValueError(f"speculative_config: the draft's vocab_size is "
                         f"{draft_model.config.vocab_size}, the target's {target.vocab_size}: "
                         f"a draft must share the target's vocabulary")
    groups = draft_model.config.kv_cache_groups + target.kv_cache_groups
    kinds = {group.kind for group in groups}
    if len(kinds) > 1:
        raise ValueError(f"speculative_config: a draft model and its target need one attention "
                         f"kind, the same (their block tables are the same, and keep the blocks "
                         f"the target's kind needs), got {sorted(map(str, kinds))}; method "
                         f"'ngram' serves any model")
    if draft_model.config.max_seq_len < target.max_seq_len:  # and every position
        raise ValueError(f"speculative_config: the draft's max_seq_len "
                         f"{draft_model.config.max_seq_len} is shorter than the target's "
                         f"{target.max_seq_len}")
    return DraftProposer(draft_model.to(device).eval(), k)


# The methods this file gives, by the names speculative_config uses
nanopaged.SPECULATIVE_METHODS["ngram"] = ngram
nanopaged.SPECULATIVE_METHODS["draft"] = draft


def ngram_proposal(tokens, max_n, min_n, k):
    """Prompt lookup: the longest suffix of tokens, max_n down to min_n long, that occurred
    earlier; the up to k tokens that followed its latest earlier occurrence. [] if none."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):  # the latest first: the likeliest to recur
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


class Proposer:
    """What both proposers share: the acceptance rule, and the counts of proposed tokens and of
    those the target drew too."""

    def __init__(self, num_speculative_tokens):
        self.num_speculative_tokens = num_speculative_tokens
        self.num_proposed_tokens = self.num_accepted_tokens = 0

    @staticmethod
    def verify(draws, proposal):
        """Of the target's draws after a sequence's last token and after each proposed token,
        those it keeps: each draw while it equals the token proposed there, then the first that
        does not (or the one after the last proposal). Its K/V are computed but the last's."""
        kept = []
        for token, guess in zip(draws, proposal + [None]):
            kept.append(token)
            if token != guess:
                break
        return kept

    def count(self, proposal, tokens):
        """The commit of a step that kept tokens out of a proposal."""
        self.num_proposed_tokens += len(proposal)
        self.num_accepted_tokens += sum(t == g for t, g in zip(tokens, proposal))


class NgramProposer(Proposer):
    """Guesses that a sequence repeats itself: continuations of its own earlier text (quoting,
    code, a list). No model, no cache, and nearly free to ask."""

    def __init__(self, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min):
        super().__init__(num_speculative_tokens)
        self.max_n, self.min_n = prompt_lookup_max, prompt_lookup_min

    def bytes_per_block(self, block_size, kv_cache_dtype):
        return 0

    def allocate_cache(self, num_blocks, num_cpu_blocks, block_size, target_runner):
        return self

    def propose(self, out):
        """{seq_id: up to its reserved slots of guesses} for each (seq, slots) in out.lookahead."""
        return {seq.seq_id: ngram_proposal(seq.token_ids, self.max_n, self.min_n, slots)
                for seq, slots in out.lookahead}


class DraftProposer(Proposer):
    """A smaller model with the target's vocabulary guesses greedily, one token per forward.
    Its KV cache is paged by the same block tables (one allocator, one set of block ids, two
    caches), so it follows every block copy the scheduler orders: preemption, swap,
    copy-on-write and prefix caching cover it with no code of its own. It runs on every token
    the target runs, so a block that holds the target's K/V holds the draft's as well."""

    def __init__(self, draft, num_speculative_tokens):
        super().__init__(num_speculative_tokens)
        self.draft = draft

    def cache_dtype(self, kv_cache_dtype):  # 8-bit like the target's, else the draft's own
        if kv_cache_dtype.itemsize == 1:
            return kv_cache_dtype
        return next(self.draft.parameters()).dtype

    def bytes_per_block(self, block_size, kv_cache_dtype):  # the budget pays for both caches
        return (math.prod(kv_block_shape(self.draft.config, block_size))
                * self.cache_dtype(kv_cache_dtype).itemsize)

    def allocate_cache(self, num_blocks, num_cpu_blocks, block_size, target_runner):
        self.runner = ModelRunner(self.draft, num_blocks, num_cpu_blocks, block_size,
                                  target_runner.backend, target_runner.device,
                                  self.cache_dtype(target_runner.kv_cache.dtype))
        self.runner.connector = target_runner.connector  # the CPU tier moves its blocks too
        return self

    def propose(self, out):
        """Guesses for each (seq, slots) in out.lookahead, by 1 + max(slots) forwards of the
        draft: the step's own tokens (its K/V for everything the target computes this step, and
        each first guess), then each sequence's latest guess, at the slot reserved for it. The
        last forward only writes the K/V of the last guesses, so that however many of them the
        target keeps, the draft's cache holds every token the target's does."""
        self.runner.copy_blocks(out.copies)
        if not out.scheduled:
            return {}
        chunks = list(step_chunks(out.scheduled, {}))
        logits = self.runner.forward(chunks, prompt_logprobs=False)                 # (R, V)
        rows = {c.seq.seq_id: i for i, c in enumerate(c for c in chunks if c.num_logits)}
        live = list(out.lookahead)  # (seq, slots) still guessing
        guesses = logits[[rows[seq.seq_id] for seq, _ in live]].argmax(-1).tolist()
        proposals = {seq.seq_id: [] for seq, _ in live}
        while live:
            chunks = []
            for (seq, _), token in zip(live, guesses):
                proposal = proposals[seq.seq_id]
                proposal.append(token)
                chunks.append(Chunk(seq=seq, start=len(seq) + len(proposal) - 1, tokens=[token],
                                    num_logits=1))
            logits = self.runner.forward(chunks, prompt_logprobs=False)             # (S, V)
            more = [i for i, (seq, slots) in enumerate(live)
                    if len(proposals[seq.seq_id]) < slots]
            live, guesses = [live[i] for i in more], logits[more].argmax(-1).tolist()
        return proposals

