"""Runtime: paged KV cache, continuous-batching scheduler, sampler, detokenizer, engine."""
