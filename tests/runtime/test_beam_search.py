"""BeamSearch step for step against transformers' own beam-search helpers on hypothesis-generated
log-probabilities (every early_stopping mode, length penalties of both signs, EOS hits)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.utils import GenerationMixin as G

from runtime.beam_search import BeamSearch


@settings(max_examples=150, deadline=None)
@given(k=st.integers(1, 4), vocab=st.integers(6, 12), prompt_len=st.integers(1, 5), max_new=st.integers(1, 12),
       length_penalty=st.sampled_from([1.0, 0.0, 0.5, 2.0, -1.0]), early_stopping=st.sampled_from([True, False, "never"]),
       n_eos=st.integers(0, 3), seed=st.integers(0, 2 ** 31 - 1), scale=st.sampled_from([0.3, 1.0, 4.0]),
       eos_bias=st.sampled_from([0.0, 1.5, 3.0]))
def test_beam_search_matches_transformers(k, vocab, prompt_len, max_new, length_penalty, early_stopping, n_eos, seed,
                                          scale, eos_bias):
    g = torch.Generator().manual_seed(seed)
    eos_ids = list(range(n_eos))
    eos = torch.tensor(eos_ids, dtype=torch.long)
    P, max_length = prompt_len, prompt_len + max_new
    K = max(2, 1 + n_eos) * k
    # transformers' state (batch of one)
    running_sequences = torch.full((1, k, max_length), -1, dtype=torch.int64)
    running_sequences[:, :, :P] = 5
    sequences = running_sequences.clone()
    running_beam_scores = torch.zeros((1, k), dtype=torch.float)
    running_beam_scores[:, 1:] = -1e9
    beam_scores = torch.full((1, k), -1e9, dtype=torch.float)
    is_sent_finished = torch.zeros((1, k), dtype=torch.bool)
    unsatisfied = torch.ones((1, 1), dtype=torch.bool)
    running_beam_indices = torch.full((1, k, max_length - P), -1, dtype=torch.int32)
    beam_indices = running_beam_indices.clone()
    top_num_beam_mask = torch.cat((torch.ones(k, dtype=torch.bool), torch.zeros(K - k, dtype=torch.bool)))
    ours = BeamSearch(k, n_eos, P, max_new, length_penalty, early_stopping)
    beams = [[] for _ in range(k)]
    cur_len = P
    for step in range(max_new):
        logits = torch.randn(1 if step == 0 else k, vocab, generator=g) * scale
        logits[:, :n_eos] += eos_bias  # EOS often: hypotheses finish and the early-stopping rules matter
        log_probs = torch.log_softmax(logits, dim=-1).expand(k, vocab).contiguous()
        # ours
        res = ours.step(log_probs, beams, [None] * k, frozenset(eos_ids))
        beams = [beams[b] + [t] for b, t, _ in res.selected]
        # transformers
        acc = (log_probs[None] + running_beam_scores[:, :, None]).reshape(1, -1)
        topk_lp, topk_seqs, topk_bi = G._get_top_k_continuations(
            G, accumulated_log_probs=acc, running_sequences=running_sequences, running_beam_indices=running_beam_indices,
            cur_len=cur_len, decoder_prompt_len=P, do_sample=False, beams_to_keep=K, num_beams=k, batch_size=1)
        hits = (torch.full((1, K), cur_len + 1 >= max_length)
                | torch.isin(topk_seqs[:, :, cur_len], eos))
        running_sequences, running_beam_scores, running_beam_indices = G._get_running_beams_for_next_iteration(
            G, topk_lp, topk_seqs, topk_bi, hits, k)
        sequences, beam_scores, beam_indices, is_sent_finished = G._update_finished_beams(
            G, sequences, topk_seqs, beam_scores, topk_lp, beam_indices, topk_bi, unsatisfied, is_sent_finished, hits,
            top_num_beam_mask, k, cur_len, P, length_penalty, early_stopping)
        cur_len += 1
        unsatisfied = G._check_early_stop_heuristic(unsatisfied, running_beam_scores, beam_scores, is_sent_finished,
                                                    cur_len, max_length, P, early_stopping, length_penalty)
        done = not G._beam_search_has_unfinished_sequences(unsatisfied, is_sent_finished, hits, early_stopping)
        # the same state
        assert torch.equal(ours.running_scores, running_beam_scores[0])
        assert [b for b in beams] == running_sequences[0, :, P:cur_len].tolist()
        assert torch.equal(ours.fin_scores, beam_scores[0]) and torch.equal(ours.fin_flags, is_sent_finished[0])
        for i, h in enumerate(ours.fin):
            ref = sequences[0, i, P:].tolist()
            assert h.token_ids == ref[: len(h.token_ids)] and all(t == -1 for t in ref[len(h.token_ids):])
        assert res.done == done
        if done:
            break
