"""Beam search bookkeeping for one request, step for step as transformers'
``GenerationMixin._beam_search`` (transformers 4.5x/5.x, batch of one).

Each step takes the processed log-probabilities of the ``k`` running beams and picks the
top ``K = max(2, 1 + #eos) * k`` continuations over all beams (float32 scores, as
transformers keeps them); continuations that hit EOS or the length limit among the
first ``k`` become finished hypotheses (score / generated_len ** length_penalty, the best
``k`` kept), the best ``k`` unfinished ones become the next running beams, and the
``early_stopping`` heuristics decide when the search ends. Which KV blocks the beams
hold is the engine's business: this class only says which beam continues with which
token (``Step.selected``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG = -1.0e9


@dataclass
class Hypothesis:
    token_ids: list[int]
    score: float  # with the length penalty
    cumulative_logprob: float
    logprobs: list | None
    finished: bool  # False: a placeholder or unfinished beam kept in the finished set (as transformers does)


@dataclass
class Step:
    selected: list[tuple[int, int, float]]  # (running beam index, token, new cumulative logprob) per new beam
    done: bool


class BeamSearch:
    def __init__(self, num_beams: int, num_eos: int, prompt_len: int, max_new_tokens: int,
                 length_penalty: float, early_stopping: bool | str):
        k = num_beams
        self.k = k
        self.K = max(2, 1 + num_eos) * k
        self.prompt_len = prompt_len
        self.max_length = prompt_len + max_new_tokens
        self.cur_len = prompt_len
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.running_scores = torch.zeros(k, dtype=torch.float32)
        self.running_scores[1:] = _NEG
        self.fin_scores = torch.full((k,), _NEG, dtype=torch.float32)
        self.fin_flags = torch.zeros(k, dtype=torch.bool)
        self.fin: list[Hypothesis] = [Hypothesis([], _NEG, 0.0, None, False) for _ in range(k)]
        self.unsatisfied = torch.ones(1, dtype=torch.bool)
        self.done = False

    def step(self, log_probs: torch.Tensor, beam_tokens: list[list[int]], beam_logprobs: list[list | None],
             eos: frozenset[int], entries=None) -> Step:
        """``log_probs[k, V]`` (float32, processed) of the running beams, whose generated tokens are
        ``beam_tokens``; ``entries(beam, token)`` builds a logprobs entry (or None)."""
        k, K = self.k, self.K
        V = log_probs.shape[-1]
        scores = (log_probs + self.running_scores[:, None]).reshape(1, -1)
        topk_lp, topk_idx = torch.topk(scores, k=K)
        topk_lp, topk_idx = topk_lp[0], topk_idx[0]
        beams = (topk_idx // V).tolist()
        toks = (topk_idx % V).tolist()
        at_limit = self.cur_len + 1 >= self.max_length
        hits = torch.tensor([at_limit or t in eos for t in toks], dtype=torch.bool)

        # e. the best k unfinished continuations run on
        running_lp = topk_lp + hits.to(torch.float32) * _NEG
        next_idx = torch.topk(running_lp[None], k=k)[1][0]
        new_scores = running_lp[next_idx]
        lps = log_probs[beams, toks].tolist() if entries is not None else None

        def cand_logprobs(c):
            if entries is None or beam_logprobs[beams[c]] is None:
                return None
            return beam_logprobs[beams[c]] + [entries(beams[c], toks[c], lps[c])]

        selected = [(beams[i], toks[i], float(topk_lp[i])) for i in next_idx.tolist()]

        # f. finished hypotheses: the top-k continuations that hit a stop, if they beat the kept ones
        top_mask = torch.arange(K) < k
        did = hits & top_mask
        fin_cand = topk_lp / ((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        full = torch.all(self.fin_flags) & (self.early_stopping is True)
        fin_cand += full.to(torch.float32) * _NEG
        fin_cand += (~self.unsatisfied).to(torch.float32) * _NEG
        fin_cand += (~did) * _NEG
        merged = torch.cat((self.fin_scores, fin_cand))
        merged_flags = torch.cat((self.fin_flags, did))
        keep = torch.topk(merged[None], k=k)[1][0]
        new_fin = []
        for i in keep.tolist():
            if i < k:
                new_fin.append(self.fin[i])
            else:
                c = i - k
                new_fin.append(Hypothesis(beam_tokens[beams[c]] + [toks[c]], float(merged[i]), float(topk_lp[c]),
                                          cand_logprobs(c), bool(did[c])))
        self.fin = new_fin
        self.fin_scores = merged[keep]
        self.fin_flags = merged_flags[keep]
        self.running_scores = new_scores

        # g. stop?
        self.cur_len += 1
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = self.cur_len - self.prompt_len
        best_possible = self.running_scores[:1] / (best_len ** self.length_penalty)
        worst = torch.where(self.fin_flags, torch.min(self.fin_scores), _NEG)
        self.unsatisfied = self.unsatisfied & torch.any(best_possible > worst)
        more = bool(self.unsatisfied) and not (bool(torch.all(self.fin_flags)) and self.early_stopping is True) \
            and not bool(torch.all(hits))
        self.done = not more
        if lps is not None:
            selected_entries = [entries(beams[i], toks[i], lps[i]) for i in next_idx.tolist()]
        else:
            selected_entries = None
        self.last_entries = selected_entries
        return Step(selected, self.done)

    def best(self, n: int) -> list[Hypothesis]:
        return self.fin[:n]
